"""Local objectives written once (issues #40, #55): FedProx's proximal term, a pull towards a model
the handler names (an anchor) and frozen layers reach local training through one definition on
every engine, stacked on the batched one; a term the stacked step cannot group stops the run as the
engine's error or is said once; several trainings in one handler each take their own settings and
seed stream."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import registry
from fedcluster_flwr.algorithms.baselines.strategy import FedAvg, FractionOptions
from fedcluster_flwr.client import local_objective
from fedcluster_flwr.algorithms.fedprox.math import ProximalTerm
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.engines import batched as batched_module
from fedcluster_flwr.engines.batched import EngineError
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.engines.stacked import ClientBatchData, train_stacked
from fedcluster_flwr.models import build_model
from fedcluster_flwr.protocol import OBJECTIVE_KEY, ProtocolError
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.training import START, Objective, TrainSettings, train

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
            torch.testing.assert_close(q, p, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
            if objective.is_frozen(name):
                assert torch.equal(p, p0) and torch.equal(q, p0), f"{name} is frozen but changed"
            else:
                assert not torch.equal(p, p0), f"{name} did not train"


def test_the_proximal_term_is_eq_2s_second_term():
    parameters = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    start = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    # (mu / 2) * ||w - w^t||^2 = 0.25 * (1 + 4 + 4)
    assert float(ProximalTerm(0.5)(parameters, start)) == pytest.approx(0.25 * 9)
    # anchored to another model the training names (Ditto's pull to the global model): the objective
    # hands each term the anchor it names
    anchors = {START: parameters, "global": start}
    assert float(Objective(terms=(ProximalTerm(0.5, anchor="global"),)).penalty(parameters, anchors)) == pytest.approx(0.25 * 9)
    assert float(Objective(terms=(ProximalTerm(0.5),)).penalty(parameters, anchors)) == 0.0


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


def mean_distance(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.mean([np.abs(x - y).mean() for x, y in zip(a, b, strict=True)]))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_term_anchored_to_a_model_the_handler_names_trains_alike_alone_and_stacked(optimizer):
    """Each client's own anchor ("global": here another freshly initialised model per client) reaches
    the term on both paths, and the pull is towards it, not towards the training's start. (Anchors
    far out of the models' scale, all weights 1 or 2, blow the activations up: then the two paths'
    rounding, 1e-7 apart, grows to 1e-2 within six steps, which says nothing about the term.)"""
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.05, optimizer=optimizer, momentum=0.5, weight_decay=0.0)
    sizes = [24, 17, 24]
    torch.manual_seed(5)
    alone = [build_model("cnn_digits", (1, 8, 8), 10) for _ in sizes]
    together = copy.deepcopy(alone)
    starts = [[p.detach().numpy().copy() for p in m.state_dict().values()] for m in alone]
    targets = [[p.detach().numpy().copy() for p in build_model("cnn_digits", (1, 8, 8), 10).state_dict().values()]
               for _ in sizes]
    objective = Objective(terms=(ProximalTerm(10.0, anchor="global"),))  # lr x mu = 0.5: a strong, stable pull
    data = digits_clients(sizes)
    expected = [train(m, d.x, d.y, settings, torch.Generator().manual_seed(k), CPU, objective, {"global": targets[k]})
                for k, (m, d) in enumerate(zip(alone, data))]
    got = train_stacked(together, data, settings, [torch.Generator().manual_seed(k) for k in range(3)], CPU, objective,
                        [{"global": t} for t in targets])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for k, (a, b) in enumerate(zip(alone, together)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"client {k}, {name}: {m}")
        now = [p.detach().numpy() for p in a.state_dict().values()]
        # measured: SGD ends at 2 % of the start's distance to the anchor, Adam (steps bounded by lr) at 35 %
        assert mean_distance(now, targets[k]) < (0.1 if optimizer == "sgd" else 0.5) * mean_distance(starts[k], targets[k])


# ---- terms the stacked step cannot take, and what the run says (issue #55) ------------------------------


@dataclass(frozen=True)
class DictTerm:
    """A term that keeps its weights in a dict: unhashable, so the batched engine cannot group it."""

    weights: dict = field(default_factory=lambda: {"scale": 0.1})

    def __call__(self, parameters, anchor):
        return self.weights["scale"] * torch.stack([p.square().sum() for p in parameters.values()]).sum()


@dataclass(frozen=True)
class TensorTerm:
    """A term that holds a tensor: hashable, but by identity, so no two clients' terms are equal."""

    centre: tuple

    def __call__(self, parameters, anchor):
        return 0.1 * torch.stack([p.square().sum() for p in parameters.values()]).sum() + 0 * self.centre[0].sum()


class WithObjective(FedAvg):
    name = "fedavg"

    def local_objective(self):
        return {OBJECTIVE_KEY: "test_term"}


@pytest.mark.parametrize("term, says", [
    (lambda config: DictTerm(), None),
    (lambda config: TensorTerm((torch.zeros(1),)), "objectives that differ"),
], ids=["dict", "tensor"])
def test_a_term_the_stacked_step_cannot_group_stops_the_run_or_is_said_once(tmp_path, monkeypatch, caplog, term, says):
    """A term holding a dict cannot be hashed: the batched run stops with the engine's error, never
    as every client failing (the run went on at chance before). A term holding a tensor hashes by
    identity: each client trains alone, and the run says so once."""
    monkeypatch.setitem(registry.OBJECTIVES, "test_term", ((), lambda config: Objective(terms=(term(config),))))
    settings, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (
        "rounds=2", "strategy.name=fedavg", "simulation.engine=batched", "partition.num_clients=8",
        "partition.num_groups=2")])
    make = lambda setup: WithObjective(FractionOptions(1.0), setup)  # noqa: E731
    if says is None:
        with pytest.raises(EngineError, match=r"cannot be grouped .*TypeError: unhashable type: 'dict'.*hashable, comparable"):
            run_in_process(settings, tmp_path / "run", make)
        return
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        strategy = run_in_process(settings, tmp_path / "run", make)
    assert sum(says in r.getMessage() for r in caplog.records) == 1
    assert all(r["fit_failures"] == 0 for r in strategy.observer.recorder.rows)


def test_two_trainings_in_one_handler_each_take_their_own_stream_and_settings_on_every_engine():
    """A handler's second training with ``stream=1`` sees other batches than its first; ``lr`` and
    ``epochs`` are its own; the batched engine stacks each of the round's trainings as the in-process
    engine runs them one by one."""
    from fedcluster_flwr.engines.batched import BatchedCompute, BatchPolicy, Rendezvous, execute
    from fedcluster_flwr.experiment import Experiment

    settings, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("partition.num_clients=4", "partition.num_groups=2")])
    weights = Experiment(settings).weights()

    def two_trainings(client):
        first, second, third = (client.load_model(weights) for _ in range(3))
        client.train_model(first, 3)
        client.train_model(second, 3, stream=1)
        client.train_model(third, 3, epochs=1, lr=0.5)
        return [np.concatenate([p.detach().numpy().ravel() for p in m.parameters()]) for m in (first, second, third)]

    alone = [two_trainings(Experiment(settings).client(pid, 4)) for pid in range(4)]
    for first, second, third in alone:
        assert not np.array_equal(first, second)  # another batch order
        assert not np.allclose(first, third, atol=1e-3)  # other epochs and learning rate
    policy = BatchPolicy(stack_on_cpu=True, memory_bytes=2**30)
    rendezvous = Rendezvous(lambda batch: execute(batch, policy))
    clients = [Experiment(settings).client(pid, 4) for pid in range(4)]
    for pid, client in enumerate(clients):
        client.compute = BatchedCompute(rendezvous, pid)
    together = [value for ok, value in rendezvous.run_all([lambda c=c: two_trainings(c) for c in clients])]
    for mine, theirs in zip(together, alone):
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
