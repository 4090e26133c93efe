"""The wire protocol: the codec, every task's reply schema, and a strategy that refuses a reply
breaking its task's schema with a reason and goes on."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fedcluster_flwr import protocol
from fedcluster_flwr.models import parameters_with_prefixes
from fedcluster_flwr.protocol import ACCURACY, EVALUATE, MODEL, MODELS, TRAIN, ModelSpec, ProtocolError, Sent
from fedcluster_flwr.schema import ConfigError
from fedcluster_flwr.algorithms.baselines.strategy import FedAvg, FractionOptions
from fedcluster_flwr.algorithms.dac.tasks import GOSSIP_TRAIN
from fedcluster_flwr.algorithms.oneshot.tasks import (
    EIGENVALUES,
    EIGENVECTORS,
    FEATURE_DIM_KEY,
    GRAM_EIGEN,
    NUM_EIGENVECTORS_KEY,
    RELEVANCE,
    RELEVANCE_ROW,
    SHARE_EIGENVALUES_KEY,
)
from fedcluster_flwr.algorithms.base.selection import DIRECTIONS, SELECTED, TRAIN_SELECT
from helpers import SHAPES, client_manager, constant_model, synthetic_round, make_setup, select_metrics

SPEC = ModelSpec.of(["w", "b"], [np.zeros(s, np.float32) for s in SHAPES])
ONES = constant_model(1.0)  # a valid model, for replies whose values do not matter


# ---- codec ------------------------------------------------------------------------------------


def test_pack_then_unpack_gives_the_named_blocks_back():
    blocks = {MODELS: [constant_model(v) for v in (1, 2, 3)], DIRECTIONS: [constant_model(-v) for v in (1, 2, 3)]}
    parameters, layout = protocol.pack_parameters(blocks)
    arrays = protocol.parameters_to_arrays(parameters)
    assert layout == "models=3x2,directions=3x2" and len(arrays) == 12
    unpacked = protocol.unpack(arrays, layout)
    assert list(unpacked) == [MODELS, DIRECTIONS]
    for name, items in blocks.items():
        for sent, got in zip(items, unpacked[name], strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(sent, got, strict=True))


def test_serialized_parameters_decode_to_the_same_blocks_and_share_repeated_items():
    shared = constant_model(7)
    cache: dict = {}
    first, layout = protocol.pack_parameters({MODELS: [shared, constant_model(1)]}, cache)
    second, _ = protocol.pack_parameters({MODELS: [shared]}, cache)
    assert second.tensors[0] is first.tensors[0]  # the shared model was serialized once
    assert cache[id(shared)][0] is shared  # and is kept alive: its id cannot be reused by another model
    unpacked = protocol.unpack(protocol.parameters_to_arrays(first), layout)
    np.testing.assert_array_equal(unpacked[MODELS][0][0], shared[0])


@pytest.mark.parametrize(
    "layout, count, message",
    [
        ("models=2x2", 2, "needs more than the 2 arrays"),
        ("models=1x2", 3, "accounts for 2 of the 3 arrays"),
        ("models:1x2", 2, "malformed layout entry 'models:1x2'"),
        (7, 2, "must be a string"),
    ],
)
def test_a_layout_that_does_not_fit_the_arrays_is_refused(layout, count, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.unpack([np.zeros(1)] * count, layout)


def test_an_instruction_without_its_task_blocks_or_scalars_is_a_programming_error():
    with pytest.raises(ProtocolError, match=r"task 'train': missing \['models'\], unexpected \['eigenvectors'\]"):
        TRAIN.check_instruction({EIGENVECTORS: []}, {})
    with pytest.raises(ProtocolError, match="missing \\['num_eigenvectors', 'features', 'feature_dim', 'feature_seed', 'pretrained_weights', 'share_eigenvalues'\\]"):
        GRAM_EIGEN.check_instruction({}, {})
    TRAIN_SELECT.check_instruction({MODELS: [ONES], DIRECTIONS: [ONES]}, {})  # directions are optional


# ---- reply schemas: one valid reply and its broken variants per task -------------------------


def selection(k: int, with_similarity: bool = False) -> dict:
    """The metrics of a valid selection reply over k models."""
    return select_metrics(0, [0.5] * k, [0.1] * k if with_similarity else [])


EIGEN_SENT = Sent({}, {NUM_EIGENVECTORS_KEY: 3, FEATURE_DIM_KEY: 5, SHARE_EIGENVALUES_KEY: True})
CASES = {
    # task: (sent, valid arrays, valid metrics, [(label, arrays, metrics, expected message)])
    TRAIN: (Sent({MODELS: 1}, {}), ONES, {}, [
        ("one array too few", ONES[:1], {}, r"expected arrays of shapes \[\(4, 3\), \(3,\)\], got \[\(4, 3\)\]"),
        ("wrong shape", [np.zeros((3, 4), np.float32), np.zeros(3, np.float32)], {}, "expected arrays of shapes"),
        ("NaN", [np.full((4, 3), np.nan, np.float32), np.zeros(3, np.float32)], {}, "non-finite values"),
        ("integers", [np.zeros((4, 3), np.int64), np.zeros(3, np.int64)], {}, "wrong kind"),
        ("huge", constant_model(3e7), {}, "values beyond"),
    ]),
    TRAIN_SELECT: (Sent({MODELS: 3}, {}), ONES, selection(3), [
        ("no selected", ONES, selection(3) | {SELECTED: None}, "'selected' must be an integer in 0..2"),
        ("selected out of range", ONES, selection(3) | {SELECTED: 3}, "'selected' must be an integer in 0..2"),
        ("selected a bool", ONES, selection(3) | {SELECTED: True}, "'selected' must be an integer"),
        ("a loss missing", ONES, {SELECTED: 0, "loss_0": 1.0, "loss_1": 1.0}, "'loss_2' must be a number"),
        ("two models back", ONES + ONES, selection(3), "expected arrays of shapes"),
    ]),
    GRAM_EIGEN: (EIGEN_SENT, [np.zeros((3, 5), np.float32), np.ones(3, np.float32)], {}, [
        ("k too small", [np.zeros((2, 5), np.float32), np.ones(2, np.float32)], {}, r"\(3, 5\), \(3,\)"),
        ("no eigenvalues", [np.zeros((3, 5), np.float32)], {}, "expected arrays of shapes"),
        ("a negative eigenvalue", [np.zeros((3, 5), np.float32), -np.ones(3, np.float32)], {}, "eigenvalues values must be >= 0"),
    ]),
    RELEVANCE_ROW: (Sent({EIGENVECTORS: 4}, {}), [np.ones(4, np.float32)], {}, [
        ("a row of the wrong length", [np.ones(3, np.float32)], {}, r"\[\(4,\)\], got \[\(3,\)\]"),
        ("a relevance above 1", [np.full(4, 5.0, np.float32)], {}, "relevance values must be <= 1, got 5"),
        ("a negative relevance", [np.full(4, -3.0, np.float32)], {}, "relevance values must be >= 0, got -3"),
    ]),
    GOSSIP_TRAIN: (Sent({MODELS: 3}, {}), ONES, {"loss_0": 0.3, "loss_1": 0.2}, [
        ("one loss per neighbour", ONES, {"loss_0": 0.3}, "'loss_1' must be a finite number .*2 in all"),
        ("infinite loss", ONES, {"loss_0": 0.3, "loss_1": float("inf")}, "'loss_1' must be a finite number"),
        ("negative loss", ONES, {"loss_0": -0.3, "loss_1": 0.2}, "'loss_0' must be a finite number >= 0"),
    ]),
    EVALUATE: (Sent({MODELS: 1}, {}), [], {ACCURACY: 0.75}, [
        ("accuracy above 1", [], {ACCURACY: 1.5}, r"'accuracy' must be a number in \[0, 1\]"),
        ("accuracy a string", [], {ACCURACY: "high"}, "'accuracy' must be a number"),
        ("arrays where none are due", ONES, {ACCURACY: 0.5}, r"expected arrays of shapes \[\]"),
        ("a NaN validation loss", [], {ACCURACY: 0.5, "val_loss": float("nan")}, "'val_loss' must be a finite number"),
    ]),
}


@pytest.mark.parametrize("task", list(CASES), ids=lambda t: t.name)
def test_every_task_accepts_its_valid_reply_and_names_itself_when_refusing_a_broken_one(task):
    sent, arrays, metrics, broken = CASES[task]
    assert task.problem_with_reply(arrays, metrics, sent, SPEC) is None
    unpacked = task.unpack_reply(arrays, sent, SPEC)
    assert list(unpacked) == list(task.reply)
    for label, bad_arrays, bad_metrics, message in broken:
        problem = task.problem_with_reply(bad_arrays, bad_metrics, sent, SPEC)
        assert problem is not None and problem.startswith(f"task {task.name}: "), label
        assert re.search(message, problem), (label, problem)


def test_similarities_are_required_only_when_directions_were_sent():
    with_directions = Sent({MODELS: 2, DIRECTIONS: 2}, {})
    assert "similarity_0" in TRAIN_SELECT.problem_with_reply(ONES, selection(2), with_directions, SPEC)
    assert TRAIN_SELECT.problem_with_reply(ONES, selection(2, True), with_directions, SPEC) is None


def test_eigenvalues_are_part_of_a_gram_eigen_reply_only_when_shared():
    """The paper's relevance (eq. 3) needs no eigenvalues of the others: its users send none, and a
    reply that carries them anyway is refused."""
    unshared = Sent({}, EIGEN_SENT.config | {SHARE_EIGENVALUES_KEY: False})
    vectors, values = np.zeros((3, 5), np.float32), np.ones(3, np.float32)
    assert GRAM_EIGEN.problem_with_reply([vectors], {}, unshared, SPEC) is None
    assert "expected arrays of shapes [(3, 5)]" in GRAM_EIGEN.problem_with_reply([vectors, values], {}, unshared, SPEC)
    assert GRAM_EIGEN.unpack_reply(GRAM_EIGEN.pack_reply({EIGENVECTORS: [vectors], EIGENVALUES: []}), unshared, SPEC)[EIGENVALUES] == []


def test_replies_unpack_into_their_declared_blocks():
    vectors, values = np.arange(15, dtype=np.float32).reshape(3, 5), np.ones(3, np.float32)
    blocks = GRAM_EIGEN.unpack_reply(GRAM_EIGEN.pack_reply({EIGENVALUES: [values], EIGENVECTORS: [vectors]}), EIGEN_SENT, SPEC)
    np.testing.assert_array_equal(blocks[EIGENVECTORS][0], vectors)
    np.testing.assert_array_equal(blocks[EIGENVALUES][0], values)
    assert list(RELEVANCE_ROW.reply) == [RELEVANCE] and list(TRAIN.reply) == [MODEL]
    with pytest.raises(ProtocolError, match="replies with \\['eigenvectors', 'eigenvalues'\\]"):
        GRAM_EIGEN.pack_reply({EIGENVECTORS: [vectors]})


# ---- the strategy refuses a broken reply, says why, and goes on -------------------------------


def test_a_reply_breaking_its_schema_is_rejected_with_the_reason_and_the_round_goes_on(tmp_path, caplog):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3, rounds=1))
    replies = [constant_model(1.0), constant_model(2.0)[:1], constant_model(3.0)]  # client 1 leaves out an array
    with caplog.at_level("WARNING"):
        synthetic_round(strategy, client_manager(3), 1, lambda client: (replies[client.pid], 10, {}))
    np.testing.assert_allclose(strategy.models[0][0], 2.0)  # the mean of clients 0 and 2 only
    assert "reply of client 1 rejected: task train: expected arrays of shapes" in caplog.text
    row = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert row["rejected_updates"] == 1 and row["fit_failures"] == 0


def test_shared_layers_are_chosen_by_name_prefix_and_an_unknown_prefix_lists_the_names():
    names = ["conv.0.weight", "conv.0.bias", "fc.0.weight", "fc_extra.weight", "out.bias"]
    assert parameters_with_prefixes(names, ["conv"], "strategy.shared_layers") == [0, 1]
    assert parameters_with_prefixes(names, ["fc", "out.bias"], "strategy.shared_layers") == [2, 4]
    with pytest.raises(ConfigError, match="strategy.shared_layers: 'cnv' names no parameter .*: conv.0.weight, conv.0.bias"):
        parameters_with_prefixes(names, ["cnv"], "strategy.shared_layers")
