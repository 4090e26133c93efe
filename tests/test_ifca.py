"""IFCA and gradloss: the client's identity rules on real digits data, and the strategies driven
round by round with synthetic clients (who receives what, FedAvg per identity, empty clusters)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.client import TaskInput, round_seed
from fedcluster_flwr.clustering import purity
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.protocol import MODELS, TRAIN
from fedcluster_flwr.results.checkpoints import load_checkpoint
from fedcluster_flwr.results.round_log import resume
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.algorithms.base.strategy import UNASSIGNED
from fedcluster_flwr.algorithms.multimodel.strategy import IFCA, GradLoss, GradLossOptions, IFCAOptions
from fedcluster_flwr.algorithms.base.selection import (
    DIRECTIONS,
    LAMBDA_KEY,
    LOCAL_UPDATE_KEY,
    LOSS_REDUCTION_KEY,
    ONE_STEP,
    SELECT,
    SELECTED,
    SELECTION_BATCH_KEY,
    SIMILARITY,
    TRAIN_SELECT,
    score_models,
    selection_metrics,
    selection_sample,
    train_best_model,
)
from fedcluster_flwr.training import get_weights, selection_score_inputs
from helpers import (
    connect_test_run,
    DIM,
    Received,
    SyntheticClient,
    synthetic_grid,
    synthetic_round,
    flat,
    make_setup,
    random_weights,
    select_metrics,
    unflatten,
)

# ---- the client's rules, on real data ---------------------------------------------------------


@pytest.fixture(scope="module")
def digits_client():
    config, _ = load_config(DEFAULT_CONFIG, [parse_override("strategy.name=fedavg")])
    return config, Experiment(config).client(0, config.partition.num_clients)


def trained(client, weights, rounds=3):
    model = client.load_model(weights)
    for rnd in range(1, rounds + 1):
        client.train_model(model, rnd)
    return get_weights(model)


def scores(client, models, directions=None, **config):
    blocks = {MODELS: models} | ({DIRECTIONS: directions} if directions is not None else {})
    return score_models(client, TaskInput(7, blocks, config), [client.load_model(m) for m in models])


def test_ifca_picks_the_model_with_the_lowest_training_loss(digits_client):
    config, client = digits_client
    untrained = Experiment(config).weights()
    good = trained(client, untrained)
    for batch, reduction in ((0, "mean"), (16, "sum"), (16, "mean")):
        metrics = scores(client, [untrained, good, untrained],
                         **{SELECTION_BATCH_KEY: batch, LOSS_REDUCTION_KEY: reduction})
        assert metrics[SELECTED] == 1, (batch, reduction)
        assert metrics["loss_1"] < metrics["loss_0"] == pytest.approx(metrics["loss_2"])


def test_sum_reduction_scales_the_loss_by_the_batch(digits_client):
    config, client = digits_client
    model = Experiment(config).weights()
    mean = scores(client, [model], **{SELECTION_BATCH_KEY: 16, LOSS_REDUCTION_KEY: "mean"})
    total = scores(client, [model], **{SELECTION_BATCH_KEY: 16, LOSS_REDUCTION_KEY: "sum"})
    assert total["loss_0"] == pytest.approx(16 * mean["loss_0"], rel=1e-5)


def test_the_data_that_made_an_update_scores_a_positive_similarity(digits_client):
    """S_k = cos(-grad L_k, dw_k): a client whose own training produced dw_k continues in that
    direction, so S_k > 0; the reversed step scores the opposite; a zero step scores 0, not NaN."""
    config, client = digits_client
    before = Experiment(config).weights()
    after = trained(client, before, rounds=1)
    step = [a - b for a, b in zip(after, before)]
    model = client.load_model(after)
    x, y = selection_sample(client, 3, 32)
    _, s_own = selection_score_inputs(model, x, y, "sum", client.device, step)
    _, s_reversed = selection_score_inputs(model, x, y, "sum", client.device, [-a for a in step])
    _, s_zero = selection_score_inputs(model, x, y, "sum", client.device, [np.zeros_like(a) for a in step])
    assert s_own > 0.1 and s_reversed == pytest.approx(-s_own) and s_zero == 0.0


def test_gradloss_rule_trades_similarity_against_loss_and_lambda_zero_is_ifca(digits_client):
    config, client = digits_client
    start = Experiment(config).weights()
    better = trained(client, start, rounds=2)  # lower loss, but a step pointing away from this client
    step_here = [a - b for a, b in zip(trained(client, start, rounds=1), start)]
    away = [-a for a in step_here]
    settings = {SELECTION_BATCH_KEY: 32, LOSS_REDUCTION_KEY: "mean"}
    models, directions = [start, better], [step_here, away]
    ifca = scores(client, models, **settings)
    for weight in (0.0, 0.2):
        gradloss = scores(client, models, directions, **settings, **{LAMBDA_KEY: weight})
        assert gradloss[SELECTED] == ifca[SELECTED] == 1  # the loss decides
        assert gradloss["loss_0"] == pytest.approx(ifca["loss_0"]) and gradloss["loss_1"] == pytest.approx(ifca["loss_1"])
    by_direction = scores(client, models, directions, **settings, **{LAMBDA_KEY: 1.0})
    assert by_direction["similarity_0"] > 0 > by_direction["similarity_1"]
    assert by_direction[SELECTED] == 0  # lambda = 1: only the direction counts


def test_the_selection_mini_batch_is_seeded_per_round_and_client(digits_client):
    _, client = digits_client
    x1, _ = selection_sample(client, 3, 10)
    x2, _ = selection_sample(client, 3, 10)
    x3, _ = selection_sample(client, 4, 10)
    assert torch.equal(x1, x2) and not torch.equal(x1, x3) and len(x1) == 10
    assert len(selection_sample(client, 3, 0)[1]) == client.num_train


@pytest.mark.parametrize("with_directions", [False, True])
def test_one_step_returns_the_chosen_model_minus_lr_times_its_gradient_on_the_selection_batch(digits_client, with_directions):
    """Lin et al., eq. 5: w_s - lr * grad L_s(Z), L a sum over the seeded mini-batch Z, checked
    against autograd by hand on the chosen model; no training epochs."""
    config, client = digits_client
    start = Experiment(config).weights()
    good = trained(client, start)
    settings = {SELECTION_BATCH_KEY: 16, LOSS_REDUCTION_KEY: "sum", LOCAL_UPDATE_KEY: ONE_STEP, LAMBDA_KEY: 0.2}
    blocks = {MODELS: [start, good]}
    if with_directions:
        blocks[DIRECTIONS] = [[np.zeros_like(a) for a in start], [a - b for a, b in zip(good, start)]]
    output = train_best_model(client, TaskInput(7, blocks, settings))
    assert output.metrics[SELECTED] == 1 and output.num_examples == 16
    assert (protocol.indexed(SIMILARITY, 1) in output.metrics) == with_directions

    model = client.load_model(good)
    x, y = selection_sample(client, 7, 16)
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    gradients = torch.autograd.grad(loss, list(model.parameters()))
    expected = [(w - client.settings.lr * g).detach().numpy() for w, g in zip(model.parameters(), gradients)]
    for got, want in zip(output.blocks[protocol.MODEL], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert output.metrics["loss_1"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert output.metrics[protocol.TRAIN_LOSS] == pytest.approx(float(loss.detach()) / 16, rel=1e-6)


def test_the_selection_batch_takes_exactly_size_samples_and_all_of_them_unshuffled_at_their_number(digits_client):
    _, client = digits_client
    x, y = selection_sample(client, 3, 1)
    assert len(y) == 1
    everything = selection_sample(client, 3, client.num_train)
    assert torch.equal(everything[0], client.data.x_train) and torch.equal(everything[1], client.data.y_train)


def test_the_selection_batch_depends_on_the_client_its_seed_and_its_own_stream(digits_client):
    """Seeded by (seed, round, client) on a stream of its own: another client, another seed, and
    the round's training order (the first permutation ``train`` draws) all give other samples."""
    _, client = digits_client
    size, server_round = 10, 3
    x, _ = selection_sample(client, server_round, size)
    other_client, other_seed = copy.copy(client), copy.copy(client)
    other_client.pid, other_seed.seed = client.pid + 1, client.seed + 1
    assert not torch.equal(selection_sample(other_client, server_round, size)[0], x)
    assert not torch.equal(selection_sample(other_seed, server_round, size)[0], x)
    training = torch.Generator().manual_seed(round_seed(client.seed, server_round, client.pid))
    training_order = torch.randperm(client.num_train, generator=training)
    assert not torch.equal(client.data.x_train[training_order[:size]], x)


def test_without_selection_settings_the_loss_is_the_mean_over_all_samples_and_lambda_is_0(digits_client):
    """The defaults: ``selection_batch`` 0 (all training samples), ``loss_reduction`` mean and
    ``lambda`` 0 (IFCA's rule even when directions come along)."""
    config, client = digits_client
    _, blocks = better_model_and_opposite_directions(config, client)
    metrics = scores(client, blocks[MODELS], blocks[DIRECTIONS])
    assert metrics[SELECTED] == 1  # lambda 1 would take model 0, whose direction is this client's
    assert metrics["loss_0"] == pytest.approx(mean_training_loss(client, blocks[MODELS][0]), rel=1e-5)


def better_model_and_opposite_directions(config, client):
    """Model 1 trained two rounds from the initial model 0; direction 0 is this client's own first
    step, direction 1 its opposite: ``(model 1, the blocks of a one-step selection)``."""
    start = Experiment(config).weights()
    better = trained(client, start, rounds=2)
    step_here = [a - b for a, b in zip(trained(client, start, rounds=1), start)]
    return better, {MODELS: [start, better], DIRECTIONS: [step_here, [-a for a in step_here]]}


def mean_training_loss(client, weights) -> float:
    """The mean cross-entropy of ``weights`` over all of the client's training samples."""
    model = client.load_model(weights)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(client.data.x_train), client.data.y_train))


def test_one_step_without_selection_settings_uses_all_samples_the_mean_loss_and_lambda_0(digits_client):
    config, client = digits_client
    better, blocks = better_model_and_opposite_directions(config, client)
    output = train_best_model(client, TaskInput(7, blocks, {LOCAL_UPDATE_KEY: ONE_STEP}))
    assert output.metrics[SELECTED] == 1 and output.num_examples == client.num_train
    mean_loss = mean_training_loss(client, better)
    assert output.metrics["loss_1"] == pytest.approx(mean_loss, rel=1e-5)
    assert output.metrics[protocol.TRAIN_LOSS] == pytest.approx(mean_loss, rel=1e-5)  # a mean: not divided again


def test_one_step_takes_lambda_from_the_instruction(digits_client):
    config, client = digits_client
    _, blocks = better_model_and_opposite_directions(config, client)
    settings = {LOCAL_UPDATE_KEY: ONE_STEP, SELECTION_BATCH_KEY: 32, LAMBDA_KEY: 1.0}
    assert train_best_model(client, TaskInput(7, blocks, settings)).metrics[SELECTED] == 0  # only the direction counts


@pytest.mark.parametrize(
    ("losses", "similarities", "weight", "selected"),
    [
        # lambda S - (1 - lambda) L at lambda 0.5: [-0.5, -0.25], so model 1 (weighing L by 1.5: [-1.5, -1.75], model 0)
        ([1.0, 1.5], [0.0, 1.0], 0.5, 1),
        ([1.0, 2.0], [], 0.0, 0),  # IFCA: the lowest loss
        ([float("nan"), 2.0, 3.0], [], 0.0, 1),  # a NaN loss is never the best
        ([1.0, 2.0], [float("nan"), 0.0], 0.5, 1),  # nor a NaN similarity
    ],
)
def test_selection_metrics_choose_by_lin_et_al_eq_4_and_never_a_nan_score(losses, similarities, weight, selected):
    metrics = selection_metrics(losses, similarities, weight)
    assert metrics[SELECTED] == selected
    assert [metrics[f"loss_{k}"] for k in range(len(losses))] == pytest.approx(losses, nan_ok=True)


# ---- the strategies, with synthetic clients ----------------------------------------------------

GROUPS = np.repeat(np.arange(3), 4)  # 12 clients, 3 true clusters
TARGETS = np.random.default_rng(0).normal(size=(3, DIM)) * 5


def strategy_of(cls, tmp_path, rounds=6, **options):
    opts = dict(num_clusters=3, client_fraction=0.5) | options
    options_cls = GradLossOptions if cls is GradLoss else IFCAOptions
    setup = make_setup(tmp_path, len(GROUPS), true=GROUPS, rounds=rounds, init_weights=random_weights)
    return cls(options_cls(**opts), setup)


def selecting_client(chooser=None) -> SyntheticClient:
    """A synthetic client: picks the model nearest its group's target (or ``chooser(pid, k)``'s
    pick of the k models), pulls it halfway to the target; ``select`` replies carry no arrays."""

    def reply(client: Received):
        target = TARGETS[GROUPS[client.pid]]
        metrics = {protocol.TRAIN_LOSS: 1.0}
        chosen = 0
        if client.task in (TRAIN_SELECT.name, SELECT.name):
            losses = [float(np.linalg.norm(flat(m) - target)) for m in client.models]
            chosen = int(np.argmin(losses)) if chooser is None else chooser(client.pid, len(client.models))
            similarities = [0.0] * len(client.models) if DIRECTIONS in client.blocks else []
            metrics |= select_metrics(chosen, losses, similarities)
        if client.task == SELECT.name:
            return [], 10, metrics
        w = flat(client.models[chosen])
        return unflatten(w + 0.5 * (target - w)), 10 + client.pid, metrics

    return reply


def test_sampled_clients_get_all_models_and_the_others_are_asked_once(tmp_path):
    strategy, manager = strategy_of(IFCA, tmp_path), synthetic_grid(len(GROUPS))
    received = synthetic_round(strategy, manager, 1, selecting_client())
    tasks = {pid: client.task for pid, client in received.items()}
    assert sorted(tasks.values()).count(TRAIN_SELECT.name) == 6 and sorted(tasks.values()).count(SELECT.name) == 6
    for client in received.values():
        assert len(client.models) == 3 and DIRECTIONS not in client.blocks
    assert (strategy.assignment != UNASSIGNED).all()  # everyone has an identity after round 1
    received = synthetic_round(strategy, manager, 2, selecting_client())
    assert {client.task for client in received.values()} == {TRAIN_SELECT.name} and len(received) == 6
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    model_bytes = sum(a.nbytes for a in random_weights(0))
    assert rows[1]["bytes_down"] > 6 * 3 * model_bytes  # K models to every sampled client


def test_one_step_with_every_device_sends_all_k_models_to_all_devices_every_iteration(tmp_path):
    """Lin et al., Algorithm 1, line 3: the K models go to every device, every iteration."""
    strategy = strategy_of(GradLoss, tmp_path, client_fraction=1.0, local_update="one_step")
    manager = synthetic_grid(len(GROUPS))
    for rnd in (1, 2, 3):
        received = synthetic_round(strategy, manager, rnd, selecting_client())
        assert sorted(received) == list(range(len(GROUPS)))
        for client in received.values():
            assert client.task == TRAIN_SELECT.name and len(client.models) == len(client.blocks[DIRECTIONS]) == 3
            assert client.config[LOCAL_UPDATE_KEY] == ONE_STEP


def test_models_are_averaged_per_identity_and_an_unchosen_cluster_keeps_its_model(tmp_path):
    strategy, manager = strategy_of(IFCA, tmp_path, client_fraction=1.0), synthetic_grid(len(GROUPS))
    start = {k: flat(m).copy() for k, m in strategy.models.items()}
    synthetic_round(strategy, manager, 1, selecting_client(lambda pid, k: 0 if pid < 6 else 2))  # nobody picks cluster 1
    assert strategy.assignment.tolist() == [0] * 6 + [2] * 6
    np.testing.assert_array_equal(flat(strategy.models[1]), start[1])
    for cluster, members in ((0, range(6)), (2, range(6, 12))):
        pulled = [flat(unflatten(start[cluster] + 0.5 * (TARGETS[GROUPS[p]] - start[cluster]))) for p in members]
        expected = np.average(pulled, axis=0, weights=[10 + p for p in members])
        np.testing.assert_allclose(flat(strategy.models[cluster]), expected, rtol=1e-5)
    assert strategy.observer.recorder.rows[-1]["cluster_sizes"] == [6, 0, 6]


def test_an_empty_cluster_is_given_a_sampled_client_only_with_reseed_empty(tmp_path):
    always_first = lambda pid, k: 0  # noqa: E731 - every client picks cluster 0
    plain = strategy_of(IFCA, tmp_path / "plain", client_fraction=1.0)
    synthetic_round(plain, synthetic_grid(len(GROUPS)), 1, selecting_client(always_first))
    received = synthetic_round(plain, synthetic_grid(len(GROUPS)), 2, selecting_client(always_first))
    assert {len(client.models) for client in received.values()} == {3}

    strategy = strategy_of(IFCA, tmp_path / "reseed", client_fraction=1.0, cluster_guard="reseed_empty")
    manager = synthetic_grid(len(GROUPS))
    synthetic_round(strategy, manager, 1, selecting_client(always_first))
    assert strategy.to_reseed == [1, 2]
    kept = {k: flat(strategy.models[k]).copy() for k in (1, 2)}
    received = synthetic_round(strategy, manager, 2, selecting_client(always_first))
    given = {pid: client for pid, client in received.items() if len(client.models) == 1}
    assert len(given) == 2 and {client.task for client in given.values()} == {TRAIN_SELECT.name}
    for cluster, pid in strategy.forced.items():
        np.testing.assert_array_equal(flat(given[pid].models[0]), kept[cluster])  # updates the empty cluster's model
        assert strategy.assignment[pid] == cluster
        assert not np.array_equal(flat(strategy.models[cluster]), kept[cluster])
    assert sorted(strategy.observer.recorder.rows[-1]["cluster_sizes"]) == [1, 1, 10]
    assert strategy.observer.recorder.rows[-1]["forced_clients"] == {str(k): p for k, p in strategy.forced.items()}


def test_one_per_cluster_gives_every_cluster_a_member_every_round(tmp_path):
    """Lin et al., §II-C: each iteration K random devices are forced one to each cluster, even
    when every device would choose the same model."""
    strategy = strategy_of(IFCA, tmp_path, client_fraction=1.0, cluster_guard="one_per_cluster")
    manager = synthetic_grid(len(GROUPS))
    forced_over_rounds = []
    for rnd in range(1, 5):
        before = {k: flat(m).copy() for k, m in strategy.models.items()}
        received = synthetic_round(strategy, manager, rnd, selecting_client(lambda pid, k: 0))
        assert sorted(strategy.forced) == [0, 1, 2] and len(set(strategy.forced.values())) == 3
        for cluster, pid in strategy.forced.items():
            assert len(received[pid].models) == 1
            np.testing.assert_array_equal(flat(received[pid].models[0]), before[cluster])
            assert not np.array_equal(flat(strategy.models[cluster]), before[cluster])  # every cluster moved
        assert min(strategy.observer.recorder.rows[-1]["cluster_sizes"]) >= 1
        forced_over_rounds.append(tuple(sorted(strategy.forced.values())))
    assert len(set(forced_over_rounds)) > 1  # random devices, not the same ones every round


def test_a_guard_that_cannot_fill_every_cluster_and_one_step_with_another_optimizer_are_config_errors():
    base = ["strategy.name=ifca", "strategy.num_clusters=4"]
    with pytest.raises(ConfigError, match="strategy.cluster_guard: one_per_cluster .* samples only 2"):
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in base + ["strategy.client_fraction=0.1", "strategy.cluster_guard=one_per_cluster"]])
    with pytest.raises(ConfigError, match=r"strategy.local_update: one_step .* \(got adam, momentum"):
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in base + ["strategy.local_update=one_step", "client.optimizer=adam"]])
    with pytest.raises(ConfigError, match="strategy.cluster_guard: expected one of none, reseed_empty, one_per_cluster"):
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in base + ["strategy.cluster_guard=always"]])


def test_gradloss_sends_zero_directions_first_then_each_clusters_last_update(tmp_path):
    strategy = strategy_of(GradLoss, tmp_path, client_fraction=1.0, lambda_=0.5)
    manager = synthetic_grid(len(GROUPS))
    received = synthetic_round(strategy, manager, 1, selecting_client(lambda pid, k: 0 if pid < 6 else 2))
    assert received[0].config[LAMBDA_KEY] == 0.5 and received[0].config[LOSS_REDUCTION_KEY] == "sum"
    assert all(not np.any(a) for item in received[0].blocks[DIRECTIONS] for a in item)
    received = synthetic_round(strategy, manager, 2, selecting_client(lambda pid, k: 0 if pid < 6 else 2))
    directions = received[0].blocks[DIRECTIONS]
    assert any(np.any(a) for a in directions[0]) and not any(np.any(a) for a in directions[1])  # 1 never updated
    before = {k: flat(m).copy() for k, m in strategy.models.items()}
    synthetic_round(strategy, manager, 3, selecting_client(lambda pid, k: 0 if pid < 6 else 2))
    for cluster in (0, 2):
        np.testing.assert_allclose(flat(strategy.directions[cluster]), flat(strategy.models[cluster]) - before[cluster],
                                   rtol=1e-5, atol=1e-6)


def test_a_cluster_nobody_updated_last_round_sends_a_zero_direction(tmp_path):
    """Lin et al., eq. 2: Δw_k^{t-1} is the mean update of cluster k's devices in iteration t-1;
    a cluster idle in t-1 has Δw_k = 0 (so S_k = 0), not its older, stale update."""
    strategy = strategy_of(GradLoss, tmp_path, client_fraction=1.0)
    manager = synthetic_grid(len(GROUPS))
    synthetic_round(strategy, manager, 1, selecting_client(lambda pid, k: 0 if pid < 6 else 2))  # clusters 0 and 2 move
    synthetic_round(strategy, manager, 2, selecting_client(lambda pid, k: 0))  # only cluster 0 moves
    received = synthetic_round(strategy, manager, 3, selecting_client(lambda pid, k: 0))
    directions = received[0].blocks[DIRECTIONS]
    assert any(np.any(a) for a in directions[0])
    assert not any(np.any(a) for a in directions[2])  # updated in round 1, idle in round 2


def test_identity_changes_and_a_checkpoint_that_resumes(tmp_path):
    strategy = strategy_of(GradLoss, tmp_path, rounds=2, client_fraction=1.0)
    manager = synthetic_grid(len(GROUPS))
    synthetic_round(strategy, manager, 1, selecting_client(lambda pid, k: 0))
    before_round_2 = {k: [a.copy() for a in m] for k, m in strategy.models.items()}
    synthetic_round(strategy, manager, 2, selecting_client(lambda pid, k: 1 if pid < 3 else 0))
    row = strategy.observer.recorder.rows[-1]
    assert row["identity_changes"] == 3
    expected = np.mean([np.ptp([np.linalg.norm(flat(m) - TARGETS[GROUPS[p]]) for m in before_round_2.values()])
                        for p in range(12)])
    assert row["mean_loss_spread"] == pytest.approx(expected, rel=1e-5) and row["mean_similarity_spread"] == 0.0
    checkpoint = load_checkpoint(tmp_path)
    resumed = strategy_of(GradLoss, tmp_path / "other", rounds=2, client_fraction=1.0)
    resume(resumed, connect_test_run(resumed), checkpoint)
    assert resumed.asked == set(range(12)) and sorted(resumed.directions) == [0, 1]
    np.testing.assert_array_equal(flat(resumed.directions[1]), flat(strategy.directions[1]))


def test_warmup_trains_one_model_then_spawns_k_distinct_ones(tmp_path):
    strategy = strategy_of(IFCA, tmp_path, warmup_rounds=2)
    manager = synthetic_grid(len(GROUPS))
    for rnd in (1, 2):
        received = synthetic_round(strategy, manager, rnd, selecting_client())
        assert {client.task for client in received.values()} == {TRAIN.name} and strategy.phase(rnd) == "warmup"
    assert len(strategy.models) == 1
    warm = flat(strategy.models[0]).copy()
    received = synthetic_round(strategy, manager, 3, selecting_client())  # spawned when the first round after the warm-up starts
    assert {client.task for client in received.values()} == {TRAIN_SELECT.name, SELECT.name}
    sent = [flat(m) for m in next(iter(received.values())).models]
    assert len(sent) == 3 and not np.array_equal(sent[0], sent[1])
    assert all(0 < np.abs(v - warm).max() < 0.1 for v in sent)  # the warm model plus small noise


def test_the_spawned_models_are_the_warm_model_plus_seeded_gaussian_noise_on_every_entry(tmp_path):
    strategy = strategy_of(IFCA, tmp_path, warmup_rounds=2, warmup_noise=0.01)
    manager = synthetic_grid(len(GROUPS))
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, selecting_client())
    warm = [a.copy() for a in strategy.models[0]]
    received = synthetic_round(strategy, manager, 3, selecting_client())
    sent = next(iter(received.values())).models
    noise = np.random.default_rng([strategy.setup.seed, 2])  # the run's seed and the warm-up's length
    for model in sent:
        expected = [a + noise.normal(scale=0.01, size=a.shape) for a in warm]
        assert [a.dtype for a in model] == [a.dtype for a in warm]
        for got, want in zip(model, expected):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_purity_is_the_share_of_clients_in_their_clusters_majority():
    true = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    identities = np.array([5, 5, 7, 7, 7, 7, 9, 9])  # cluster 7 holds one of true 0 and three of true 1
    assert purity(true, identities) == pytest.approx((2 + 3 + 2) / 8)
