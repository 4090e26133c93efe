"""Ditto (Li et al., 2021) and what it needs of the clients: a personal model kept on the client's
node (client state), an objective anchored to the model the server sent, two trainings in one
handler. Checked by effect, on real digits clients, on both in-process engines (Ray: slow tier):
λ = 0 is ``local`` bit for bit; the global model is ``fedavg``'s; a large λ brings the personal
models to the global model's accuracy; a round uploads what FedAvg's uploads; a stopped run resumed
from its checkpoint, the clients' personal models included, continues bit for bit."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from helpers import assert_same_state, rows_without_timing
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.results.checkpoints import load_checkpoint
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.declarations.schema import ConfigError

BASE = ("rounds=4", "partition.num_clients=8", "partition.num_groups=2", "client.epochs=1")
SAME = ("round", "mean_client_accuracy", "client_accuracy", "mean_test_loss", "per_true_cluster_accuracy",
        "num_fit_clients", "fit_failures", "rejected_updates")


def config(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*BASE, *overrides)])[0]


def rows(strategy) -> list[dict]:
    return strategy.observer.recorder.rows


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_with_lambda_0_the_personal_models_are_local_training_bit_for_bit(tmp_path, engine):
    ditto = run_in_process(config("strategy.name=ditto", "strategy.lambda=0", "strategy.client_fraction=1.0",
                                  f"simulation.engine={engine}"), tmp_path / "ditto")
    local = run_in_process(config("strategy.name=local", f"simulation.engine={engine}"), tmp_path / "local")
    for mine, theirs in zip(rows(ditto), rows(local), strict=True):
        assert {k: mine[k] for k in SAME} == {k: theirs[k] for k in SAME}, mine["round"]
    kept = load_checkpoint(tmp_path / "ditto")["clients"]
    for pid, model in local.client_models.items():  # the personal models are on the nodes, not on the server
        assert all(np.array_equal(a, b) for a, b in zip(kept[pid]["personal"], model, strict=True)), pid
    assert ditto.client_models == {}


def test_the_global_model_is_fedavgs_and_a_round_uploads_what_fedavgs_uploads(tmp_path):
    ditto = run_in_process(config("strategy.name=ditto", "strategy.lambda=0.5", "strategy.client_fraction=0.5"),
                           tmp_path / "ditto")
    fedavg = run_in_process(config("strategy.name=fedavg", "strategy.client_fraction=0.5"), tmp_path / "fedavg")
    assert all(np.array_equal(a, b) for a, b in zip(ditto.models[0], fedavg.models[0], strict=True))
    assert [r["bytes_up"] for r in rows(ditto)] == [r["bytes_up"] for r in rows(fedavg)]
    assert [r["fit_clients"] for r in rows(ditto)] == [r["fit_clients"] for r in rows(fedavg)]
    assert all(r["mean_global_model_accuracy"] == pytest.approx(f["mean_client_accuracy"])
               for r, f in zip(rows(ditto), rows(fedavg)))  # the global model, evaluated as FedAvg evaluates it


def test_a_large_lambda_brings_the_personal_models_to_the_global_models_accuracy(tmp_path):
    """Label-swapped groups: the personal models (λ = 0) learn each group's labels and leave the
    global model behind (+12.5 points after 6 rounds); pulled towards it they follow it, λ = 10
    (lr·λ = 0.5) to within a few points. Pulled to w^t, the model a round starts from, they trail the
    global model by about one round (round 6: 0.656 against the global model's 0.669 of round 5 and
    0.694 of round 6), hence slightly below it."""
    gaps = {}
    for lam in (0, 1, 10):
        strategy = run_in_process(config("strategy.name=ditto", f"strategy.lambda={lam}", "strategy.client_fraction=1.0",
                                         "rounds=6"), tmp_path / str(lam))
        last = rows(strategy)[-1]
        gaps[lam] = last["mean_client_accuracy"] - last["mean_global_model_accuracy"]
    assert gaps[0] > 0.05 and abs(gaps[10]) < 0.05 and gaps[0] > gaps[1] > gaps[10], gaps


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_a_stopped_ditto_run_resumes_its_clients_personal_models_bit_for_bit(tmp_path, engine):
    settings = config("strategy.name=ditto", "strategy.client_fraction=0.5", f"simulation.engine={engine}")
    whole = run_in_process(settings, tmp_path / "whole")
    run_in_process(settings, tmp_path / "stopped", stop_after=2)
    assert set(load_checkpoint(tmp_path / "stopped")["clients"]) == set(np.flatnonzero(whole_trained_by(2, whole)))
    resumed = run_in_process(settings, tmp_path / "stopped", resume=True)
    assert rows_without_timing(rows(resumed)) == rows_without_timing(rows(whole))
    assert_same_state(load_checkpoint(tmp_path / "stopped"), load_checkpoint(tmp_path / "whole"), skip=("wall_seconds",))


def whole_trained_by(round_done: int, whole) -> np.ndarray:
    """Which clients had been sent Ditto's training by ``round_done`` in ``whole``'s rows."""
    trained = np.zeros(whole.setup.num_clients, dtype=bool)
    for row in rows(whole)[:round_done]:
        trained[row["fit_clients"]] = True
    return trained


def test_a_40_client_ditto_run_on_the_batched_engine_is_stacked_and_uploads_fedavgs_bytes(tmp_path, caplog):
    overrides = ("partition.num_clients=40", "rounds=3", "strategy.client_fraction=0.5", "simulation.engine=batched")
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        ditto = run_in_process(config("strategy.name=ditto", *overrides), tmp_path / "ditto")
    assert not [r for r in caplog.records if "one at a time" in r.getMessage()]  # both trainings stacked
    fedavg = run_in_process(config("strategy.name=fedavg", *overrides), tmp_path / "fedavg")
    assert [r["bytes_up"] for r in rows(ditto)] == [r["bytes_up"] for r in rows(fedavg)]


def test_lambda_is_declared_at_least_0_and_named_by_its_key():
    with pytest.raises(ConfigError, match=r"^strategy.lambda: must be >= 0"):
        config("strategy.name=ditto", "strategy.lambda=-1")


@pytest.mark.slow
def test_on_flowers_ray_engine_the_personal_models_stay_on_the_nodes_and_resume_from_the_checkpoint(tmp_path):
    """Through Flower's simulation runtime (``fedcluster run``): the same rounds as in process, and a
    run stopped after round 2 and resumed on Ray gives the uninterrupted run's rounds, its clients'
    personal models read from Flower's node contexts into the checkpoint and written back."""
    from fedcluster_flwr.results.run_files import read_rounds
    from fedcluster_flwr.runner import continue_run, plan_continuation, run_experiment

    settings = config("strategy.name=ditto", "strategy.client_fraction=0.5")
    in_process = run_in_process(settings, tmp_path / "inprocess")
    run_experiment(settings, tmp_path / "ray")
    assert rows_without_timing(read_rounds(tmp_path / "ray")) == rows_without_timing(rows(in_process))
    run_experiment(settings, tmp_path / "stopped", stop_after=2)
    assert load_checkpoint(tmp_path / "stopped")["clients"]  # Flower's node contexts, checkpointed
    continue_run(plan_continuation(tmp_path / "stopped"))
    assert rows_without_timing(read_rounds(tmp_path / "stopped")) == rows_without_timing(rows(in_process))


@pytest.mark.parametrize(("strategy", "key"), [("ditto", "lambda"), ("fedprox", "mu")])
def test_a_proximal_weight_plain_sgd_cannot_take_is_refused_naming_it(strategy, key):
    """lr·λ ≥ 2(1 + momentum) makes SGD on the proximal term alone diverge: every model NaN, every
    reply refused, the run at chance without a word (λ = 100 at lr 0.05 did). Adam has no such bound."""
    with pytest.raises(ConfigError, match=rf"^strategy.{key}: 100 × learning rate 0.05 = 5 is not below "
                                          r"2\(1 \+ client.momentum\) = 2: .* take it below 40"):
        config(f"strategy.name={strategy}", f"strategy.{key}=100")
    config(f"strategy.name={strategy}", f"strategy.{key}=39")
    config(f"strategy.name={strategy}", f"strategy.{key}=100", "client.optimizer=adam", "client.lr=0.001")
    config(f"strategy.name={strategy}", f"strategy.{key}=50", "client.momentum=0.5")  # 2.5 < 2(1 + 0.5)


def test_dittos_bound_takes_the_personal_learning_rate_where_it_is_given():
    config("strategy.name=ditto", "strategy.lambda=100", "strategy.personal_lr=0.01")
    with pytest.raises(ConfigError, match=r"^strategy.lambda: 100 × learning rate 0.5 = 50 "):
        config("strategy.name=ditto", "strategy.lambda=100", "strategy.personal_lr=0.5", "client.lr=0.001")


@pytest.mark.parametrize("lr_times_weight", [1.9, 2.1])
def test_the_bound_is_where_sgd_on_the_term_alone_starts_to_diverge(lr_times_weight):
    """The bound's reason, shown: 50 SGD steps on (λ/2)||w − a||² from ||w − a|| = 1 shrink it
    below lr·λ = 2 and blow it up above."""
    import torch

    from fedcluster_flwr.algorithms.fedprox.math import ProximalTerm

    anchor = {"w": torch.zeros(3)}
    weights = {"w": torch.tensor([1.0, 0.0, 0.0], requires_grad=True)}
    optimizer = torch.optim.SGD(weights.values(), lr=lr_times_weight / 10)
    for _ in range(50):
        optimizer.zero_grad()
        ProximalTerm(10.0)(weights, anchor).backward()
        optimizer.step()
    distance = float(weights["w"].detach().norm())
    assert (distance < 0.1) if lr_times_weight < 2 else (distance > 10), distance
