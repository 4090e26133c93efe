"""The batched engine (``simulation.engine: batched``) against the in-process one: the same decisions
every round for every algorithm family, accuracies equal to float round-off; its stacked training
against :func:`fedcluster_flwr.training.train` client by client (unequal clients masked); its
rendezvous of client threads; a checkpoint moving between engines; ``fedcluster run`` on it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.engines import batched as batched_module
from fedcluster_flwr.engines.batched import Rendezvous, Request
from fedcluster_flwr.engines.stacked import ClientBatchData, evaluate_stacked, evaluation_sums, stack_parameters, train_stacked
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.models import build_model
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.training import TrainSettings, evaluate, train
from helpers import assert_same_state, rows_without_timing
from trajectories import CASE_STRATEGY, SETTINGS, STRATEGY_OVERRIDES

# One case of every family, on the behaviour fixture's settings (a failing client, a late joiner).
FAMILY_CASES = ("flhc", "ifca", "gradloss_one_step", "oneshot_hfl", "dac", "pens", "cfl", "pacfl")
SAME_EVERY_ROUND = (
    "phase", "fit_clients", "num_clusters", "purity", "ari", "fit_failures", "rejected_updates", "eval_failures",
    "bytes_up", "bytes_down", "num_evaluated", "pairs_met", "exchanges",
)
ACCURACY_TOLERANCE = 1e-4  # the digits confs train with SGD: float round-off, no flipped prediction
# A gossip strategy's clusters are a report, not a decision: average linkage of 1/s with every unknown
# pair at the largest known distance. Early on nearly all pairs are unknown, the distances tie, and a
# last-bit difference in one loss decides the tie (seen: 2 vs 1 clusters in round 2). What the
# strategy decides, whom each client meets, is compared instead, exactly.
GOSSIP_REPORTED = ("num_clusters", "purity", "ari")


def run_case(case: str, engine: str, tmp_path: Path, *extra: str):
    overrides = (*SETTINGS, f"strategy.name={CASE_STRATEGY.get(case, case)}", *STRATEGY_OVERRIDES[case],
                 f"simulation.engine={engine}", *extra)
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    return run_in_process(config, tmp_path / engine)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_batched_makes_the_decisions_of_inprocess_every_round(case, tmp_path):
    one_by_one, batched = run_case(case, "inprocess", tmp_path), run_case(case, "batched", tmp_path)
    rows, batched_rows = one_by_one.observer.recorder.rows, batched.observer.recorder.rows
    assert len(rows) == len(batched_rows) == 7
    gossip = hasattr(one_by_one, "communication")
    same = [k for k in SAME_EVERY_ROUND if not (gossip and k in GOSSIP_REPORTED)]
    for expected, got in zip(rows, batched_rows):
        where = f"{case}, round {expected['round']}"
        assert {k: got.get(k) for k in same} == {k: expected.get(k) for k in same}, where
        assert set(got) == set(expected), where
        assert got["client_accuracy"].keys() == expected["client_accuracy"].keys(), where
        for pid, accuracy in expected["client_accuracy"].items():
            assert got["client_accuracy"][pid] == pytest.approx(accuracy, abs=ACCURACY_TOLERANCE), f"{where}, client {pid}"
    if gossip:  # every neighbour choice of every round, summed; the similarities they were drawn by
        assert np.array_equal(batched.communication, one_by_one.communication)
        np.testing.assert_allclose(batched.similarity, one_by_one.similarity, rtol=1e-5)
    else:
        assert [int(c) for c in batched.assignment] == [int(c) for c in one_by_one.assignment]


def digits_clients(sizes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [ClientBatchData(torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator))
            for n in sizes]


@pytest.mark.parametrize("optimizer, momentum, weight_decay", [("sgd", 0.9, 1e-3), ("sgd", 0.0, 0.0), ("adam", 0.0, 1e-3)])
def test_stacked_training_is_each_clients_own_training_with_unequal_clients_masked(optimizer, momentum, weight_decay):
    # 37 samples at batch 8: a last batch of 5; 16: two full batches; 3: one short batch. The small
    # clients sit out the later steps (masked), and the steps' batch sizes differ (grouped).
    sizes = [37, 16, 3, 37, 24]
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.05, optimizer=optimizer, momentum=momentum, weight_decay=weight_decay)
    torch.manual_seed(1)
    alone = [build_model("cnn_digits", (1, 8, 8), 10) for _ in sizes]
    together = [build_model("cnn_digits", (1, 8, 8), 10) for _ in sizes]
    for a, b in zip(alone, together):
        b.load_state_dict(a.state_dict())
    data = digits_clients(sizes)
    cpu = torch.device("cpu")
    expected = [train(m, d.x, d.y, settings, torch.Generator().manual_seed(k), cpu) for k, (m, d) in enumerate(zip(alone, data))]
    got = train_stacked(together, data, settings, [torch.Generator().manual_seed(k) for k in range(len(sizes))], cpu)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # Adam divides by sqrt(v) + eps: where a gradient is near 0 its round-off (vmap convolves in
    # another order) is divided by a near-0 too, so its tolerance is that of the measurement.
    atol = 1e-4 if optimizer == "adam" else 1e-6
    for k, (a, b) in enumerate(zip(alone, together)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=atol, msg=f"client {k} ({sizes[k]} samples), {name}")


def test_stacked_evaluation_is_each_clients_own_evaluation_padding_left_out():
    torch.manual_seed(2)
    models = [build_model("mlp_digits", (1, 8, 8), 10) for _ in range(4)]
    data = digits_clients([5, 0, 13, 1], seed=3)
    got = evaluate_stacked(models, data, torch.device("cpu"))
    expected = [evaluate(m, d.x, d.y, torch.device("cpu")) if len(d.y) else (0.0, 0.0) for m, d in zip(models, data)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["cnn_zec_fmnist", "mlp_fmnist"])
def test_stacked_evaluation_in_groups_of_clients_is_one_pass_bit_for_bit(name, monkeypatch):
    """On a CPU a slice's clients go through in groups (cache-sized passes): each client's samples
    are cut into the same slices and summed in the same order, so its loss sum and correct count are
    the same bits as in one pass over all clients (unequal clients and padding included)."""
    from fedcluster_flwr.engines import stacked

    torch.manual_seed(4)
    models = [build_model(name, (1, 28, 28), 10) for _ in range(7)]
    generator = torch.Generator().manual_seed(5)
    data = [ClientBatchData(torch.randn(n, 1, 28, 28, generator=generator), torch.randint(0, 10, (n,), generator=generator))
            for n in (9, 9, 5, 0, 12, 7, 9)]
    params = stack_parameters(models, torch.device("cpu"))
    monkeypatch.setattr(stacked, "EVALUATION_SAMPLES", 28)  # slices of 4 samples per client
    sums = {}
    for pass_samples in (1 << 62, 12, 4):  # one pass; groups of 4 and 3 clients; of 2, 3 and 2
        monkeypatch.setattr(stacked, "CPU_PASS_SAMPLES", pass_samples)
        sums[pass_samples] = evaluation_sums(models[0], params, data, torch.device("cpu"))
    for grouped in (sums[12], sums[4]):
        assert torch.equal(grouped[0], sums[1 << 62][0]) and torch.equal(grouped[1], sums[1 << 62][1])
    assert sums[4][0][3] == 0 and sums[4][1][3] == 0  # the client without samples scores nothing


@pytest.mark.parametrize("num_clients", [1, 2, 3, 5, 7, 100, 500])
@pytest.mark.parametrize("step", [1, 8, 40, 600])
def test_client_groups_cover_the_stack_in_order_and_never_leave_one_client_alone(num_clients, step):
    from fedcluster_flwr.engines.stacked import CPU_PASS_SAMPLES, client_groups

    groups = client_groups(num_clients, step, torch.device("cpu"))
    assert [i for g in groups for i in range(num_clients)[g]] == list(range(num_clients))
    sizes = [g.stop - g.start for g in groups]
    assert len(groups) == 1 or min(sizes) >= 2
    assert max(sizes) * step < 2 * max(CPU_PASS_SAMPLES, 2 * step)  # about CPU_PASS_SAMPLES per pass
    assert client_groups(num_clients, step, torch.device("meta")) == [slice(0, num_clients)]  # an accelerator: one pass


def test_rendezvous_runs_all_parked_requests_together_and_a_failing_client_fails_alone():
    threads_before = threading.active_count()
    batches: list[list[int]] = []

    def execute(batch: list[Request]) -> None:
        batches.append([r.pid for r in batch])
        for request in batch:
            request.result, request.done = request.pid * 10, True

    rendezvous = Rendezvous(execute)

    def client(pid: int, requests: int):
        def call():
            if pid == 2:
                raise RuntimeError("client 2 fails before its work")
            return [rendezvous.submit(Request("evaluate", pid, None, None, None, None)) for _ in range(requests)]
        return call

    outcomes = rendezvous.run_all([client(pid, requests) for pid, requests in [(0, 2), (1, 1), (2, 1), (3, 2)]])
    assert outcomes[0] == (True, [0, 0]) and outcomes[1] == (True, [10]) and outcomes[3] == (True, [30, 30])
    assert outcomes[2][0] is False and "client 2 fails" in str(outcomes[2][1])
    assert batches == [[0, 1, 3], [0, 3]]  # first everyone's first request, then the two with a second
    assert threading.active_count() == threads_before  # the clients' threads have ended


def test_a_checkpoint_moves_between_engines(tmp_path):
    overrides = [parse_override(o) for o in ("rounds=5", "strategy.rounds_before_clustering=2")]
    inprocess, _ = load_config(DEFAULT_CONFIG, [*overrides, ("simulation.engine", "inprocess")])
    batched, _ = load_config(DEFAULT_CONFIG, [*overrides, ("simulation.engine", "batched")])
    run_in_process(inprocess, tmp_path / "moved", stop_after=3)
    moved = run_in_process(batched, tmp_path / "moved", resume=True)
    straight = run_in_process(inprocess, tmp_path / "straight")
    moved_rows, rows = moved.observer.recorder.rows, straight.observer.recorder.rows
    assert [r["round"] for r in moved_rows][-2:] == [4, 5]
    for got, expected in zip(moved_rows[-2:], rows[-2:]):
        assert got["fit_clients"] == expected["fit_clients"] and got["num_clusters"] == expected["num_clusters"]
        for pid, accuracy in expected["client_accuracy"].items():
            assert got["client_accuracy"][pid] == pytest.approx(accuracy, abs=ACCURACY_TOLERANCE)
    summary = json.loads((tmp_path / "moved" / "summary.json").read_text())
    assert summary["finished"] is True


@pytest.mark.parametrize("overrides, key", [
    (["simulation.engine=fast"], "simulation.engine"),
    (["simulation.engine=inprocess", "simulation.ray_address=127.0.0.1:6379"], "simulation.ray_address"),
    (["simulation.engine=batched", "simulation.batched_memory_gb=0"], "simulation.batched_memory_gb"),
    (["simulation.batched_memory_gb=4"], "simulation.batched_memory_gb"),  # the ray engine does not batch
])
def test_engine_settings_that_cannot_work_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    assert str(error.value).startswith(key), str(error.value)


def fedcluster(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=300)


def test_fedcluster_runs_on_one_engine_and_resumes_in_place_on_another(tmp_path):
    run_dir = tmp_path / "run"
    started = fedcluster("run", str(DEFAULT_CONFIG), "--out", str(run_dir), "--stop-after", "2",
                         "--set", "rounds=4", "--set", "strategy.rounds_before_clustering=2",
                         "--set", "simulation.engine=inprocess")
    assert started.returncode == 0, started.stderr
    resumed = fedcluster("resume", str(run_dir), "--set", "simulation.engine=batched")
    assert resumed.returncode == 0, resumed.stderr
    assert "mean client accuracy" in resumed.stdout  # fedcluster run's summary
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] is True
    assert [json.loads(line)["round"] for line in (run_dir / "rounds.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["simulation"]["engine"] == "batched"
    refused = fedcluster("resume", str(run_dir), "--rounds", "5", "--set", "client.lr=0.1")
    assert refused.returncode != 0 and "only simulation.engine" in refused.stderr


def test_batched_runs_are_bit_for_bit_repeatable_and_end_their_workers(tmp_path, monkeypatch):
    # Two workers on a CPU, even for this small conf; which worker runs which stack must not matter.
    monkeypatch.setattr(batched_module, "WORK_FOR_WORKERS", 0)
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (
        "rounds=6", "simulation.engine=batched", "simulation.batched_workers=2", "strategy.rounds_before_clustering=3")])
    first, second = run_in_process(config, tmp_path / "first"), run_in_process(config, tmp_path / "second")
    assert not [t for t in threading.enumerate() if t.name.startswith("batched-worker")]
    assert_same_state(rows_without_timing(second.observer.recorder.rows), rows_without_timing(first.observer.recorder.rows))
    assert first.models.keys() == second.models.keys()
    for a, b in zip(first.models.values(), second.models.values()):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
