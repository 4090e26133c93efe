"""The wire protocol: the codec, every task's reply schema, and a strategy that refuses a reply
breaking its task's schema with a reason and goes on."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fedcluster_flwr import protocol
from fedcluster_flwr.models import parameters_with_prefixes
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedcluster_flwr.protocol import (
    ACCURACY, CONFIG, EVALUATE, MODEL, MODELS, ROUND_KEY, TEST_LOSS, TRAIN, ModelSpec, ProtocolError, Sent,
)
from fedcluster_flwr.declarations.schema import ConfigError
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
from fedcluster_flwr.algorithms.base.selection import DIRECTIONS, SELECT, SELECTED, TRAIN_SELECT
from helpers import SHAPES, synthetic_grid, constant_model, reply_content, synthetic_round, make_setup, select_metrics

SPEC = ModelSpec.of(["w", "b"], [np.zeros(s, np.float32) for s in SHAPES])
ONES = constant_model(1.0)  # a valid model, for replies whose values do not matter


# ---- codec: arrays <-> Flower's records ------------------------------------------------------------


def test_an_instruction_travels_as_named_records_and_reads_back_as_its_blocks():
    blocks = {MODELS: [constant_model(v) for v in (1, 2, 3)], DIRECTIONS: [constant_model(-v) for v in (1, 2, 3)]}
    content = TRAIN_SELECT.instruction(blocks, {"lambda": 0.5}, 4, SPEC.names)
    assert sorted(content.array_records) == sorted([f"models.{k}" for k in range(3)] + [f"directions.{k}" for k in range(3)])
    assert list(content.array_records["models.0"]) == ["w", "b"]  # a model's arrays under its state_dict keys
    assert dict(content[CONFIG]) == {"lambda": 0.5, ROUND_KEY: 4}
    read = TRAIN_SELECT.read_instruction(content)
    assert read.server_round == 4 and read.config["lambda"] == 0.5 and list(read.blocks) == [MODELS, DIRECTIONS]
    for name, items in blocks.items():
        for sent, got in zip(items, read.blocks[name], strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(sent, got, strict=True))


def test_the_one_model_of_train_is_flowers_arrays_record():
    """So Flower's stock FedAvg (record "arrays", config "server-round", weight "num-examples") drives our train task."""
    content = TRAIN.instruction({MODEL: [ONES]}, {}, 1, SPEC.names)
    assert sorted(content) == ["arrays", "config"] and TRAIN.message_type == "train" and EVALUATE.message_type == "evaluate"
    assert TRAIN_SELECT.message_type == "train.train_select" and SELECT.message_type == "query.select"
    reply = TRAIN.reply_content({MODEL: ONES}, 12, {"train_loss": 0.5}, SPEC.names)
    assert sorted(reply) == ["arrays", "metrics"] and dict(reply["metrics"]) == {"train_loss": 0.5, "num-examples": 12}


def test_a_model_many_clients_receive_is_serialized_once():
    shared = constant_model(7)
    cache: dict = {}
    first = TRAIN_SELECT.instruction({MODELS: [shared, constant_model(1)]}, {}, 1, SPEC.names, cache)
    second = TRAIN.instruction({MODEL: [shared]}, {}, 1, SPEC.names, cache)
    assert second["arrays"] is first["models.0"]  # one record, shared, as Flower's own strategies share one
    assert cache[id(shared)][0] is shared  # and the model is kept alive: its id cannot be reused by another
    assert protocol.content_nbytes(first) == 2 * protocol.content_nbytes(second)


def instruction_with(records: dict) -> RecordDict:
    return RecordDict({CONFIG: ConfigRecord({ROUND_KEY: 1}), **records})


@pytest.mark.parametrize(
    "content, message",
    [
        (RecordDict({"arrays": ArrayRecord(ONES)}), "lacks its 'config' record"),
        (RecordDict({CONFIG: ConfigRecord({ROUND_KEY: 0}), "arrays": ArrayRecord(ONES)}), "'server-round' must be a round number"),
        (RecordDict({CONFIG: ConfigRecord({ROUND_KEY: "1"}), "arrays": ArrayRecord(ONES)}), "'server-round' must be a round number"),
        (instruction_with({}), r"missing \['arrays'\]"),
        (instruction_with({"arrays": ArrayRecord(ONES), "eigenvectors": ArrayRecord(ONES)}), "unexpected record 'eigenvectors'"),
        (instruction_with({"arrays.0": ArrayRecord(ONES), "arrays.2": ArrayRecord(ONES)}), r"must travel as \['arrays.0', 'arrays.1'\]"),
        (instruction_with({"arrays": ArrayRecord(ONES), "arrays.0": ArrayRecord(ONES)}), "must travel as"),
        (instruction_with({"arrays.0": ArrayRecord(ONES)}), r"must travel as \['arrays'\]"),
    ],
    ids=["no-config", "round-0", "round-a-string", "no-model", "unknown-block", "a-gap", "both-names", "one-item-indexed"],
)
def test_a_malformed_instruction_is_one_line_naming_what_is_wrong_before_any_work(content, message):
    with pytest.raises(ProtocolError, match=message):
        TRAIN.read_instruction(content)


def test_an_instruction_without_its_task_blocks_or_scalars_is_a_programming_error():
    with pytest.raises(ProtocolError, match=r"task 'train': missing \['arrays'\], unexpected \['eigenvectors'\]"):
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
    TRAIN: (Sent({MODEL: 1}, {}), ONES, {}, [
        ("one array too few", ONES[:1], {}, r"expected arrays of shapes \[\(4, 3\), \(3,\)\], got \[\(4, 3\)\]"),
        ("wrong shape", [np.zeros((3, 4), np.float32), np.zeros(3, np.float32)], {}, "expected arrays of shapes"),
        ("NaN", [np.full((4, 3), np.nan, np.float32), np.zeros(3, np.float32)], {}, "non-finite values"),
        ("integers", [np.zeros((4, 3), np.int64), np.zeros(3, np.int64)], {}, "wrong kind"),
        ("huge", constant_model(3e7), {}, "values beyond"),
    ]),
    TRAIN_SELECT: (Sent({MODELS: 3}, {}), ONES, selection(3), [
        ("no selected", ONES, {k: v for k, v in selection(3).items() if k != SELECTED}, "'selected' must be an integer in 0..2"),
        ("selected out of range", ONES, selection(3) | {SELECTED: 3}, "'selected' must be an integer in 0..2"),
        ("selected a float", ONES, selection(3) | {SELECTED: 1.0}, "'selected' must be an integer"),
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
    EVALUATE: (Sent({MODEL: 1}, {}), [], {ACCURACY: 0.75, TEST_LOSS: 0.4}, [
        ("accuracy above 1", [], {ACCURACY: 1.5, TEST_LOSS: 0.4}, r"'accuracy' must be a number in \[0, 1\]"),
        ("accuracy missing", [], {TEST_LOSS: 0.4}, "'accuracy' must be a number"),
        ("arrays where none are due", ONES, {ACCURACY: 0.5, TEST_LOSS: 0.4}, r"expected the records \[\], got \['arrays'\]"),
        ("a NaN validation loss", [], {ACCURACY: 0.5, TEST_LOSS: 0.4, "val_loss": float("nan")}, "'val_loss' must be a finite number"),
        ("an infinite test loss", [], {ACCURACY: 0.5, TEST_LOSS: float("inf")}, "'test_loss' must be a finite number"),
    ]),
}


def reply_records(task, arrays, sent):
    """``arrays`` cut into ``task``'s reply blocks as its schema expects them (the rest to the last),
    as a client would reply: one record per block (no record where the task replies with none)."""
    shapes = task.reply_shapes(sent, SPEC)
    blocks, start = {}, 0
    for k, name in enumerate(task.reply):
        count = len(shapes[name]) if k < len(task.reply) - 1 else len(arrays) - start
        blocks[name], start = list(arrays[start : start + count]), start + count
    if not task.reply and arrays:
        blocks[MODEL] = list(arrays)
    return reply_content(blocks)


def problem(task, arrays, metrics, sent):
    """Why the server refuses ``task``'s reply of ``arrays`` and ``metrics`` (None: it takes it)."""
    return task.problem_with_metrics(metrics, sent) or task.problem_with_arrays(reply_records(task, arrays, sent), sent, SPEC)


@pytest.mark.parametrize("task", list(CASES), ids=lambda t: t.name)
def test_every_task_accepts_its_valid_reply_and_names_itself_when_refusing_a_broken_one(task):
    sent, arrays, metrics, broken = CASES[task]
    assert problem(task, arrays, metrics, sent) is None
    for label, bad_arrays, bad_metrics, message in broken:
        found = problem(task, bad_arrays, bad_metrics, sent)
        assert found is not None and found.startswith(f"task {task.name}: "), label
        assert re.search(message, found), (label, found)


@pytest.mark.parametrize("task", [TRAIN, TRAIN_SELECT, GOSSIP_TRAIN, EVALUATE], ids=lambda t: t.name)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), "low"], ids=["inf", "nan", "a-string"])
def test_a_reply_metric_that_is_not_a_finite_number_is_refused_naming_it(task, value):
    """A train_loss of inf was silently left out of the round's mean once: now the reply is refused."""
    sent, arrays, metrics, _ = CASES[task]
    found = problem(task, arrays, metrics | {"train_loss": value}, sent)
    assert found == f"task {task.name}: metric 'train_loss' must be a finite number, got {value!r}"


def test_a_selection_may_report_a_diverged_models_loss_and_never_chooses_it():
    sent = Sent({MODELS: 3}, {})
    assert problem(TRAIN_SELECT, ONES, selection(3) | {"loss_2": float("nan")}, sent) is None


def test_similarities_are_required_only_when_directions_were_sent():
    with_directions = Sent({MODELS: 2, DIRECTIONS: 2}, {})
    assert "similarity_0" in problem(TRAIN_SELECT, ONES, selection(2), with_directions)
    assert problem(TRAIN_SELECT, ONES, selection(2, True), with_directions) is None
    assert problem(TRAIN_SELECT, ONES, selection(2), Sent({MODELS: 2}, {})) is None


def test_eigenvalues_are_part_of_a_gram_eigen_reply_only_when_shared():
    """The paper's relevance (eq. 3) needs no eigenvalues of the others: its users send none, and a
    reply that carries them anyway is refused."""
    unshared = Sent({}, EIGEN_SENT.config | {SHARE_EIGENVALUES_KEY: False})
    vectors, values = np.zeros((3, 5), np.float32), np.ones(3, np.float32)
    assert problem(GRAM_EIGEN, [vectors], {}, unshared) is None
    assert "expected arrays of shapes [(3, 5)]" in problem(GRAM_EIGEN, [vectors, values], {}, unshared)
    content = GRAM_EIGEN.reply_content({EIGENVECTORS: [vectors], EIGENVALUES: []}, 10, {})
    assert len(content.array_records[EIGENVALUES]) == 0 and GRAM_EIGEN.problem_with_arrays(content, unshared, SPEC) is None


def test_replies_carry_one_record_per_declared_block():
    vectors, values = np.arange(15, dtype=np.float32).reshape(3, 5), np.ones(3, np.float32)
    content = GRAM_EIGEN.reply_content({EIGENVALUES: [values], EIGENVECTORS: [vectors]}, 10, {})
    np.testing.assert_array_equal(protocol.record_arrays(content.array_records[EIGENVECTORS])[0], vectors)
    np.testing.assert_array_equal(protocol.record_arrays(content.array_records[EIGENVALUES])[0], values)
    assert list(RELEVANCE_ROW.reply) == [RELEVANCE] and list(TRAIN.reply) == [MODEL]
    with pytest.raises(ProtocolError, match="replies with \\['eigenvectors', 'eigenvalues'\\]"):
        GRAM_EIGEN.reply_content({EIGENVECTORS: [vectors]}, 10, {})


# ---- the strategy refuses a broken reply, says why, and goes on -------------------------------


def test_a_reply_breaking_its_schema_is_rejected_with_the_reason_and_the_round_goes_on(tmp_path, caplog):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3, rounds=1))
    replies = [constant_model(1.0), constant_model(2.0)[:1], constant_model(3.0)]  # client 1 leaves out an array
    with caplog.at_level("WARNING"):
        synthetic_round(strategy, synthetic_grid(3), 1, lambda client: (replies[client.pid], 10, {}))
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
