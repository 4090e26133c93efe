"""A new algorithm needs no special case in the core: a toy strategy, written only against the
public hooks, sends two named blocks and gets back a non-model reply from real clients (with a
toy handler), keeps its own state and models through a checkpoint, and never sees a failed
client's reply."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.inprocess import run_in_process
from fedcluster_flwr import client as client_module
from fedcluster_flwr.client import TaskInput, TaskOutput
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.experiment import make_client
from fedcluster_flwr.protocol import MODELS, ArraySpec, Task, in_unit_interval
from fedcluster_flwr.results import load_checkpoint
from fedcluster_flwr.strategies.round_log import resume
from fedcluster_flwr.strategies import ClusteredStrategy, Instruction, Reply
from fedcluster_flwr.training import evaluate

PROBES, LOSSES, SHARE = "probes", "losses", "share"
# Sends the global model and P probe directions; the reply is one training loss per probe
# (of the model moved along it), plus the share of the client's training labels below 5.
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


@dataclass(frozen=True)
class ProbeOptions:
    num_probes: int = 3


class ProbeStrategy(ClusteredStrategy):
    """Asks every online client for the losses along a few fixed random directions."""

    name = "probe"
    Options = ProbeOptions

    def __init__(self, options, setup):
        super().__init__(options, setup)
        rng = np.random.default_rng(setup.seed)
        self.probes = [[np.zeros_like(a) for a in setup.initial_weights]]  # probe 0: the model itself
        self.probes += [[rng.normal(scale=0.1, size=a.shape).astype(a.dtype) for a in setup.initial_weights]
                        for _ in range(options.num_probes - 1)]
        self.losses: dict[int, dict[int, np.ndarray]] = {}
        self.shares: dict[int, float] = {}
        self.rounds_after: list[int] = []

    def fit_instructions(self, server_round, online):
        return [Instruction(p, PROBE, {MODELS: [self.models[0]], PROBES: self.probes}) for p in online]

    def absorb(self, server_round, replies: list[Reply]):
        self.losses[server_round] = {r.pid: r.blocks()[LOSSES][0] for r in replies}
        self.shares.update({r.pid: float(r.metrics[SHARE]) for r in replies})
        self.rounds_after.append(server_round)
        return {f"losses_{server_round}.npy": np.stack([self.losses[server_round][p] for p in sorted(self.losses[server_round])])}

    def round_metrics(self, server_round):
        return {"mean_share": float(np.mean(list(self.shares.values())))}

    def artifacts(self):
        return {"probe_shares.npy": np.asarray([self.shares[p] for p in sorted(self.shares)])}

    def state_dict(self):
        return super().state_dict() | {"rounds_after": self.rounds_after, "probes": self.probes}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.rounds_after = list(state["rounds_after"])
        self.probes = [list(probe) for probe in state["probes"]]


@pytest.fixture
def probe_handler(monkeypatch):
    monkeypatch.setitem(client_module.HANDLERS, PROBE.name, (PROBE, probe_losses))


def test_a_toy_strategy_gets_non_model_replies_through_the_public_hooks(tmp_path, probe_handler):
    overrides = ["rounds=2", "strategy.name=fedavg", "simulation.fail_fit={4: [2]}"]
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    strategy = run_in_process(config, tmp_path / "run", lambda setup: ProbeStrategy(ProbeOptions(), setup))

    assert strategy.rounds_after == [1, 2]
    assert sorted(strategy.losses[1]) == list(range(20))
    assert 4 not in strategy.losses[2] and len(strategy.losses[2]) == 19  # the failed client is left out
    probe_client = make_client(config, 7, 20)
    expected = probe_client.training_loss(probe_client.load_model(strategy.models[0]))
    losses = strategy.losses[1][7]
    assert losses.shape == (3,) and losses[0] == pytest.approx(expected, rel=1e-6)
    assert not np.allclose(losses[1:], losses[0])  # the other probes moved the model
    y = probe_client.data.y_train
    assert strategy.shares[7] == pytest.approx(float((y < 5).float().mean()))
    row = strategy.log.recorder.rows[-1]
    assert row["fit_failures"] == 1 and row["rejected_updates"] == 0
    assert row["mean_share"] == pytest.approx(np.mean(list(strategy.shares.values())))
    assert np.load(tmp_path / "run" / "losses_2.npy").shape == (19, 3)  # written by the results side
    np.testing.assert_array_equal(np.load(tmp_path / "run" / "probe_shares.npy"), [strategy.shares[p] for p in range(20)])

    resumed = ProbeStrategy(ProbeOptions(), strategy.setup)
    resumed.probes = []
    resume(resumed, load_checkpoint(tmp_path / "run"))
    assert resumed.rounds_after == [1, 2] and resumed.round_offset == 2
    for restored, original in zip(resumed.probes, strategy.probes, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(restored, original, strict=True))
    _, accuracy = evaluate(probe_client.load_model(resumed.models[0]), probe_client.data.x_test,
                           probe_client.data.y_test, probe_client.device)
    assert accuracy == pytest.approx(strategy.log.latest_accuracy[7])  # the checkpointed model is the evaluated one


def test_personal_models_survive_a_checkpoint(tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=1", "strategy.name=local")])
    strategy = run_in_process(config, tmp_path / "run")
    checkpoint = load_checkpoint(tmp_path / "run")
    assert sorted(checkpoint["strategy"]["client_models"]) == list(range(20))
    fresh = type(strategy)(strategy.options, strategy.setup)
    resume(fresh, checkpoint)
    for pid in range(20):
        assert all(np.array_equal(a, b) for a, b in zip(fresh.client_models[pid], strategy.client_models[pid]))
