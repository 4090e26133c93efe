"""Every list of config keys is derived from the options' declared roles (fedcluster_flwr.declarations.roles):
a dummy option of each role, added to a copy of the config's declarations, is in every list its role
puts it in and in no other; the lists the runner, the apps and the CLI use are those derivations;
pyproject's run-config keys are the ones declared; and the keys the issue found missing (Ray's
resources and address) may now change when a run resumes in place."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from conftest import ROOT
from fedcluster_flwr import runner
from fedcluster_flwr.algorithms.base import ClusteredStrategy
from fedcluster_flwr.algorithms.base.options import SAME_MEANING, SHARE_OF_CLIENTS
from fedcluster_flwr.apps.server_app import IGNORED_UNDER_FLWR_RUN
from fedcluster_flwr.declarations.roles import (
    EXECUTION,
    FIXED_ON_BRANCH,
    NO_EFFECT_UNDER_FLWR_RUN,
    RUN_CONFIG,
    check_same_meaning,
    declared,
    default_of,
    keys_with,
    no_effect_under_flwr_run,
    run_config_keys,
    same_meaning_options,
)
from fedcluster_flwr.config.sections import ExperimentConfig, SimulationConfig
from fedcluster_flwr.registry import register, strategies
from fedcluster_flwr.declarations.schema import option
from helpers import finished_looking_run


@dataclasses.dataclass(frozen=True)
class DummySimulation(SimulationConfig):
    dummy_executes: int = option(0, roles=(EXECUTION,))
    dummy_ignored: int = option(0, roles=(no_effect_under_flwr_run("a dummy's reason"),))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DummyExperiment(ExperimentConfig):
    simulation: DummySimulation = option(factory=DummySimulation)
    dummy_fixed: int = option(0, roles=(FIXED_ON_BRANCH,))
    dummy_run_config: int = option(7, roles=(RUN_CONFIG,))


class DummyStrategy(ClusteredStrategy):
    name = "dummy_same_meaning"

    @dataclasses.dataclass(frozen=True)
    class Options:
        dummy_share: float = option(0.5, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))


DUMMIES = {
    EXECUTION.name: "simulation.dummy_executes",
    NO_EFFECT_UNDER_FLWR_RUN.name: "simulation.dummy_ignored",
    FIXED_ON_BRANCH.name: "dummy_fixed",
    RUN_CONFIG.name: "dummy_run_config",
}


ROLES = (EXECUTION, NO_EFFECT_UNDER_FLWR_RUN, FIXED_ON_BRANCH, RUN_CONFIG)


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_a_dummy_option_of_each_role_is_in_its_list_and_no_other(role):
    for other in ROLES:
        keys = keys_with(DummyExperiment, other)
        assert (DUMMIES[role.name] in keys) == (other == role), (role.name, other.name)
        assert set(keys_with(ExperimentConfig, other)) <= set(keys)  # the real declarations all still there


def test_the_lists_in_use_are_the_derived_ones():
    assert runner.EXECUTION_KEYS == keys_with(ExperimentConfig, EXECUTION)
    assert runner.BRANCH_FIXED == keys_with(ExperimentConfig, FIXED_ON_BRANCH)
    assert IGNORED_UNDER_FLWR_RUN == {key: role.reason for key, role in declared(ExperimentConfig, NO_EFFECT_UNDER_FLWR_RUN).items()}
    # and what they hold today, as the docs describe it
    assert set(runner.EXECUTION_KEYS) >= {"simulation.engine", "simulation.ray_address", "simulation.num_gpus_per_client",
                                          "simulation.num_cpus_per_client", "tracking"}
    assert runner.BRANCH_FIXED == ("dataset", "partition", "model", "client", "strategy.name", "seed")
    assert set(IGNORED_UNDER_FLWR_RUN) == {"simulation.ray_address", "simulation.num_cpus_per_client",
                                           "simulation.num_gpus_per_client", "simulation.batched_actors"}
    assert declared(DummyExperiment, NO_EFFECT_UNDER_FLWR_RUN)["simulation.dummy_ignored"].reason == "a dummy's reason"
    assert default_of(DummyExperiment, "dummy_run_config") == 7
    assert default_of(DummyExperiment, "simulation.num_cpus_per_client") == 1.0


def test_same_meaning_options_come_from_the_strategies_declarations():
    registered = list(strategies().values())
    assert same_meaning_options(registered) == ("client_fraction", "num_clusters")
    assert same_meaning_options([*registered, DummyStrategy]) == ("client_fraction", "dummy_share", "num_clusters")
    assert "strategy.dummy_share" in run_config_keys(DummyExperiment, [*registered, DummyStrategy])


def test_a_strategy_giving_a_shared_name_another_meaning_is_refused_at_registration():
    class Rogue(ClusteredStrategy):
        name = "rogue_fraction"

        @dataclasses.dataclass(frozen=True)
        class Options:
            client_fraction: float = option(0.5, SHARE_OF_CLIENTS)  # no SAME_MEANING: it would mean something else

    with pytest.raises(TypeError, match=r"Rogue.Options.client_fraction: other strategies declare client_fraction "
                                        r"with roles=\(SAME_MEANING,\)"):
        register(Rogue)
    assert "rogue_fraction" not in strategies()
    check_same_meaning(strategies().values())  # the registered ones agree


def test_pyprojects_run_config_keys_are_the_declared_ones():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        table = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]

    def flatten(node, prefix=""):
        for key, value in node.items():
            yield from flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]

    assert set(flatten(table)) - {"config", "set"} == set(run_config_keys(ExperimentConfig, strategies().values()))


@pytest.mark.parametrize("change", ["simulation.num_cpus_per_client=2", "simulation.num_gpus_per_client=0.5"])
def test_rays_resources_may_change_when_a_run_resumes_in_place(tmp_path, change):
    """A run started with a GPU share resumes on a machine without one (the case the issue found refused)."""
    continuation = runner.plan_continuation(finished_looking_run(tmp_path / "run"), overrides=[change])
    key, value = change.split("=")
    assert continuation.run_dir == (tmp_path / "run").resolve() and not continuation.is_branch
    assert getattr(continuation.config.simulation, key.split(".")[1]) == float(value)
