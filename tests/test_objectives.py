"""Local objectives written once (issue #40): FedProx's proximal term and frozen layers reach local
training through the shared ``train`` task on every engine, stacked on the batched one."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.client import local_objective
from fedcluster_flwr.algorithms.fedprox.math import ProximalTerm
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.engines import batched as batched_module
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.engines.stacked import ClientBatchData, train_stacked
from fedcluster_flwr.models import build_model
from fedcluster_flwr.protocol import ProtocolError
from fedcluster_flwr.schema import ConfigError
from fedcluster_flwr.training import Objective, TrainSettings, train

CPU = torch.device("cpu")
SGD = TrainSettings(epochs=2, batch_size=8, lr=0.1, optimizer="sgd", momentum=0.0, weight_decay=0.0)


def run(tmp_path, name, *overrides):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=3", "strategy.client_fraction=0.5", *overrides)])
    return run_in_process(config, tmp_path / name)


def test_fedprox_with_mu_0_is_fedavg_bit_for_bit(tmp_path):
    fedavg = run(tmp_path, "fedavg", "strategy.name=fedavg")
    fedprox = run(tmp_path, "fedprox", "strategy.name=fedprox", "strategy.mu=0")
    assert all(np.array_equal(a, b) for a, b in zip(fedavg.models[0], fedprox.models[0]))


def test_the_proximal_term_holds_the_model_near_the_rounds_start(tmp_path):
    start = run(tmp_path, "start", "strategy.name=fedprox", "rounds=1", "strategy.mu=0")
    free = run(tmp_path, "free", "strategy.name=fedprox", "strategy.mu=0")
    held = run(tmp_path, "held", "strategy.name=fedprox", "strategy.mu=10")
    initial = np.concatenate([a.ravel() for a in start.setup.initial_weights])
    moved = {name: np.linalg.norm(np.concatenate([a.ravel() for a in s.models[0]]) - initial) for name, s in
             (("free", free), ("held", held))}
    assert moved["held"] < 0.5 * moved["free"]


def count_stacks(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = batched_module.train_stacked

    def counted(models, *args, **kwargs):
        sizes.append(len(models))
        return real(models, *args, **kwargs)

    monkeypatch.setattr(batched_module, "train_stacked", counted)
    return sizes


def test_fedprox_is_stacked_on_the_batched_engine_and_agrees_with_inprocess(tmp_path, monkeypatch, caplog):
    sizes = count_stacks(monkeypatch)
    one_by_one = run(tmp_path, "inprocess", "strategy.name=fedprox", "strategy.mu=0.5", "simulation.engine=inprocess")
    assert sizes == []
    together = run(tmp_path, "batched", "strategy.name=fedprox", "strategy.mu=0.5", "simulation.engine=batched")
    assert sizes and all(size > 1 for size in sizes)  # every round's training ran as stacks
    assert not [r for r in caplog.records if "one at a time" in r.message]
    for a, b in zip(one_by_one.models[0], together.models[0]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def digits_clients(sizes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [ClientBatchData(torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator))
            for n in sizes]


@pytest.mark.parametrize("objective", [
    Objective(terms=(ProximalTerm(2.0),)),
    Objective(frozen=("conv",)),
    Objective(terms=(ProximalTerm(0.5),), frozen=("fc", "out.bias")),
], ids=["proximal", "frozen", "both"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_objective_trains_alike_one_client_at_a_time_and_stacked(objective, optimizer):
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.05, optimizer=optimizer, momentum=0.5, weight_decay=1e-3)
    sizes = [24, 17, 24]
    torch.manual_seed(4)
    alone = [build_model("cnn_digits", (1, 8, 8), 10) for _ in sizes]
    together = copy.deepcopy(alone)
    before = copy.deepcopy(alone)
    data = digits_clients(sizes)
    expected = [train(m, d.x, d.y, settings, torch.Generator().manual_seed(k), CPU, objective)
                for k, (m, d) in enumerate(zip(alone, data))]
    got = train_stacked(together, data, settings, [torch.Generator().manual_seed(k) for k in range(3)], CPU, objective)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    atol = 1e-4 if optimizer == "adam" else 1e-6
    for a, b, start in zip(alone, together, before):
        for (name, p), q, p0 in zip(a.named_parameters(), b.parameters(), start.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=atol, msg=name)
            if objective.is_frozen(name):
                assert torch.equal(p, p0) and torch.equal(q, p0), f"{name} is frozen but changed"
            else:
                assert not torch.equal(p, p0), f"{name} did not train"


def test_the_proximal_term_is_eq_2s_second_term():
    parameters = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    start = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    # (mu / 2) * ||w - w^t||^2 = 0.25 * (1 + 4 + 4)
    assert float(ProximalTerm(0.5)(parameters, start)) == pytest.approx(0.25 * 9)


def test_an_instruction_names_its_objective_and_its_values():
    assert local_objective({}) == Objective()
    built = local_objective({"objective": "proximal,frozen", "mu": 0.1, "frozen_layers": "conv, fc"})
    assert built.terms == (ProximalTerm(0.1),) and built.frozen == ("conv", "fc")
    with pytest.raises(ProtocolError, match="objective 'nesterov' is unknown"):
        local_objective({"objective": "nesterov"})
    with pytest.raises(ProtocolError, match=r"objective 'proximal' needs the instruction scalars \['mu'\]"):
        local_objective({"objective": "proximal"})


def test_a_frozen_layer_that_names_nothing_is_an_error_not_a_silent_no_op():
    model = build_model("cnn_digits", (1, 8, 8), 10)
    (data,) = digits_clients([8])
    with pytest.raises(ValueError, match="frozen layer 'convs' names no parameter"):
        train(model, data.x, data.y, SGD, torch.Generator().manual_seed(0), CPU, Objective(frozen=("convs",)))


def test_a_negative_mu_names_its_key_and_no_hint_to_give_what_the_command_gave():
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT_CONFIG, [("strategy.name", "fedprox"), ("strategy.mu", -0.5)], strict=True)
    assert error.value.key == "strategy.mu"
    assert "in the same command" not in str(error.value)  # strategy.mu was given in that very command
