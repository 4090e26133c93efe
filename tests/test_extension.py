"""The docs' "Add an algorithm" (docs/how-to/add-algorithm.md), walked once: a toy strategy written only against the documented
hooks, with declared options, its own task and client handler, sends two named blocks to real
clients and gets a non-model reply back, reports round metrics, a summary entry and artifacts the
results side writes, never sees a failed client's reply, and continues bit for bit from a
checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG, ROOT
from helpers import connect_test_run, assert_same_state, rows_without_timing
from fedcluster_flwr import registry
from fedcluster_flwr.client import TaskInput, TaskOutput
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.protocol import MODELS, ArraySpec, Task, in_unit_interval
from fedcluster_flwr.results.checkpoints import load_checkpoint
from fedcluster_flwr.declarations.options import DeclaredOptions, from_mapping
from fedcluster_flwr.declarations.schema import ConfigError, at_least, option
from fedcluster_flwr.algorithms.base import HOOKS, ClusteredStrategy, Instruction, Reply
from fedcluster_flwr.results.round_log import resume
from fedcluster_flwr.training import evaluate

# Step 4: a new kind of client work. Sends the global model and P probe directions; the reply is
# one training loss per probe (of the model moved along it), plus the share of training labels below 5.
PROBES, LOSSES, SHARE = "probes", "losses", "share"
PROBE = Task(
    "probe_losses",
    sends=(MODELS, PROBES),
    reply=(LOSSES,),
    reply_shapes=lambda sent, model: {LOSSES: [ArraySpec((sent.items[PROBES],))]},
    metric_checks=(in_unit_interval(SHARE),),
)


def probe_losses(client, inputs: TaskInput) -> TaskOutput:
    (weights,) = inputs.blocks[MODELS]
    losses = [client.training_loss(client.load_model([w + d for w, d in zip(weights, probe)]))
              for probe in inputs.blocks[PROBES]]
    share = float((client.data.y_train < 5).float().mean())
    return TaskOutput({LOSSES: [np.asarray(losses, np.float32)]}, client.num_train, {SHARE: share})


# Step 1: options that declare what a valid value is.
@dataclass(frozen=True)
class ProbeOptions(DeclaredOptions):
    num_probes: int = option(3, at_least(2))
    scale: float = option(0.1, at_least(0))


# Steps 2 and 3: the strategy and the hooks it needs.
class ProbeStrategy(ClusteredStrategy):
    """Asks every online client for the losses along a few seeded random directions, and moves the
    model one step along the direction of lowest mean loss (a toy zeroth-order method)."""

    name = "probe"
    Options = ProbeOptions

    def __init__(self, options, setup):
        super().__init__(options, setup)
        self.losses: dict[int, dict[int, np.ndarray]] = {}
        self.shares: dict[int, float] = {}
        self.steps: list[int] = []  # the probe taken each round
        self.sent_probes: list = []  # this round's, drawn in fit_instructions

    def probes(self, server_round):
        """Probe 0 is the model itself; the others are drawn from the strategy's RNG (checkpointed)."""
        return [[np.zeros_like(a) for a in self.models[0]]] + [
            [self.rng.normal(scale=self.options.scale, size=a.shape).astype(a.dtype) for a in self.models[0]]
            for _ in range(self.options.num_probes - 1)
        ]

    def fit_instructions(self, server_round, online):
        self.sent_probes = self.probes(server_round)
        return [Instruction(p, PROBE, {MODELS: [self.models[0]], PROBES: self.sent_probes}) for p in online]

    def absorb(self, server_round, replies: list[Reply]):
        self.losses[server_round] = {r.pid: r.blocks()[LOSSES][0] for r in replies}
        self.shares.update({r.pid: float(r.metrics[SHARE]) for r in replies})
        best = int(np.argmin(np.mean(list(self.losses[server_round].values()), axis=0)))
        self.models[0] = [w + d for w, d in zip(self.models[0], self.sent_probes[best])]
        self.steps.append(best)
        return {f"losses_{server_round}.npy": np.stack(list(self.losses[server_round].values()))}

    def phase(self, server_round):
        return "probing"

    def round_metrics(self, server_round):
        return {"probe_taken": self.steps[-1]}

    def summary_entries(self):
        return {"steps": self.steps}

    def artifacts(self):
        return {"probe_shares.npy": np.asarray([self.shares[p] for p in sorted(self.shares)])}

    def state_dict(self):
        return super().state_dict() | {"steps": self.steps, "shares": self.shares}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.steps = list(state["steps"])
        self.shares = dict(state["shares"])


@pytest.fixture
def probe_handler(monkeypatch):
    """The task's handler, registered as ``@handles(PROBE)`` would, for this test only."""
    monkeypatch.setitem(registry.HANDLERS, PROBE.name, (PROBE, probe_losses))


def make_probe(setup):
    return ProbeStrategy(ProbeOptions(), setup)


def probe_config(*extra):
    overrides = ["rounds=3", "strategy.name=fedavg", "simulation.fail_fit={4: [2]}", *extra]
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


def test_a_toy_strategy_gets_non_model_replies_through_the_public_hooks(tmp_path, probe_handler):
    config = probe_config()
    strategy = run_in_process(config, tmp_path / "run", make_probe)

    assert sorted(strategy.losses[1]) == list(range(20))
    assert 4 not in strategy.losses[2] and len(strategy.losses[2]) == 19  # the failed client is left out
    probe_client = Experiment(config).client(7, 20)
    _, accuracy = evaluate(probe_client.load_model(strategy.models[0]), probe_client.data.x_test,
                           probe_client.data.y_test, probe_client.device)
    assert accuracy == pytest.approx(strategy.observer.latest_accuracy[7])  # the model evaluated is the strategy's
    losses = strategy.losses[1][7]
    assert losses.shape == (3,) and not np.allclose(losses[1:], losses[0])  # the other probes moved the model
    assert strategy.shares[7] == pytest.approx(float((probe_client.data.y_train < 5).float().mean()))

    rows = strategy.observer.recorder.rows
    assert [r["probe_taken"] for r in rows] == strategy.steps and {r["phase"] for r in rows} == {"probing"}
    assert rows[1]["fit_failures"] == 1 and rows[1]["rejected_updates"] == 0
    run_dir = tmp_path / "run"
    assert np.load(run_dir / "losses_2.npy").shape == (19, 3)  # returned by absorb, written by the results side
    np.testing.assert_array_equal(np.load(run_dir / "probe_shares.npy"), [strategy.shares[p] for p in range(20)])
    assert load_checkpoint(run_dir)["strategy"]["steps"] == strategy.steps


def test_the_toy_strategy_resumes_from_its_checkpoint_bit_for_bit(tmp_path, probe_handler):
    config = probe_config()
    whole = run_in_process(config, tmp_path / "whole", make_probe)
    run_in_process(config, tmp_path / "stopped", make_probe, stop_after=1)
    resumed = run_in_process(config, tmp_path / "stopped", make_probe, resume=True)
    assert rows_without_timing(resumed.observer.recorder.rows) == rows_without_timing(whole.observer.recorder.rows)
    assert_same_state(resumed.state_dict(), whole.state_dict())


def test_the_toy_strategys_options_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^strategy.num_probes: must be >= 2, got 1$"):
        from_mapping(ProbeOptions, {"num_probes": 1}, "strategy")
    with pytest.raises(ConfigError, match=r"^num_probes: must be >= 2, got 1$"):  # made in code: the field
        ProbeOptions(num_probes=1)


def test_every_documented_hook_is_a_method_of_the_base_strategy():
    documented = (ROOT / "docs" / "how-to" / "add-algorithm.md").read_text()
    assert "fit_instructions" in HOOKS
    for hook in HOOKS:
        assert callable(getattr(ClusteredStrategy, hook)), hook
        assert f"`{hook}" in documented, f"hook {hook} is not in the docs' Add an algorithm"


def test_personal_models_survive_a_checkpoint(tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=1", "strategy.name=local")])
    strategy = run_in_process(config, tmp_path / "run")
    checkpoint = load_checkpoint(tmp_path / "run")
    assert sorted(checkpoint["strategy"]["client_models"]) == list(range(20))
    fresh = type(strategy)(strategy.options, strategy.setup)
    resume(fresh, connect_test_run(fresh, tmp_path / "run", resuming=True), checkpoint)
    for pid in range(20):
        assert all(np.array_equal(a, b) for a, b in zip(fresh.client_models[pid], strategy.client_models[pid]))
