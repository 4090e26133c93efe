"""Careless and hostile input (issue #42), the data, run-folder, resume and reply part: data files
checked for what they mean and not only for their shape, a CIFAR-10 batch that cannot run code,
one run per folder however two runs are started, a resume that names the file that was edited
and never continues a checkpoint under another strategy's name, one reply per client per round,
and a client that refuses a malformed instruction in one line. Each case here ran silently wrong,
named the wrong cause or ran the file's code before these checks.

The data files are tiny stand-ins written in ``tmp_path`` in their real formats (IDX, the python
CIFAR-10 batches, LEAF JSON); no dataset download is needed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from flwr.app import ConfigRecord, RecordDict

from conftest import DEFAULT_CONFIG, ROOT
from helpers import (
    CIFAR_BATCHES, configure, connect_test_run, constant_model, fit_res, make_setup, metrics_record, recorded_rows, reply_to,
    synthetic_grid, write_cifar,
)
from fedcluster_flwr import runner
from fedcluster_flwr.cli import console
from fedcluster_flwr.algorithms.baselines.strategy import FedAvg, FractionOptions
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override
from fedcluster_flwr.data import DataError, load_pool
from fedcluster_flwr.data.device import load_device_data
from fedcluster_flwr.data.sources import InputFormat
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.protocol import ACCURACY, CONFIG, EVALUATE, METRICS, MODEL, NUM_EXAMPLES, ROUND_KEY, TEST_LOSS, TRAIN, ProtocolError
from fedcluster_flwr.results.recorder import CLAIM_FILE, RunRecorder
from fedcluster_flwr.declarations.schema import ConfigError

MNIST_CONFIG = ROOT / "conf" / "mnist_iid_fedavg.yaml"
IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def fedcluster(argv: list[str], capsys: Any, monkeypatch: Any) -> tuple[int, str]:
    """``fedcluster ARGV`` in this process; the engine must never start (the mistake is found first)."""
    monkeypatch.setattr(runner, "_run_in_own_process", lambda *a, **kw: pytest.fail("the engine started"))
    code = console.main([*argv, "--no-progress"])
    return code, capsys.readouterr().err


# ---- data files: MNIST's IDX files -----------------------------------------------------------------


def mnist_raw(root: Path, train_labels: list[int] | None = None) -> Path:
    """MNIST's four IDX files under ``root/MNIST/raw``: 5 train and 3 test images of 28x28, with
    correct headers and sizes; ``train_labels`` replaces the train labels (default 0..4)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", 5), ("t10k", 3)):
        labels = train_labels if split == "train" and train_labels is not None else list(range(count))
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x0803, count, 28, 28) + bytes(784 * count))
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x0801, count) + bytes(labels))
    return raw


def test_mnist_labels_outside_0_to_9_are_one_error_naming_the_label_file(tmp_path, capsys, monkeypatch):
    """Before: a label 11 in the train labels ran to the end with 'mean client accuracy n/a', exit 0."""
    raw = mnist_raw(tmp_path / "data", train_labels=[0, 1, 11, 3, 200])
    small = ["--set", "partition.num_clients=2", "--set", "partition.samples_per_client=4", "--set", "partition.test_fraction=0.25"]
    code, err = fedcluster(["run", str(MNIST_CONFIG), "--set", f"dataset.data_dir={tmp_path / 'data'}", *small,
                            "--out", str(tmp_path / "out")], capsys, monkeypatch)
    few, *rest = err.splitlines()  # 4 samples a client: 1 test example, which the config warns of first
    assert few.startswith("warning: partition.test_fraction 0.25 leaves a client about 1 test example")
    line = one_error_line("\n".join(rest))
    assert code == 2
    assert f"{raw / LABELS} holds label 11 (item 2, one of 2 outside the classes)" in line
    assert "classes are 0..9" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("file", "keep", "expected"),
    [
        (IMAGES, 0, "is empty (0 bytes; an IDX image file holds a 16-byte header, then 784 byte(s) per image)"),
        (LABELS, 0, "is empty (0 bytes; an IDX label file holds a 8-byte header, then 1 byte(s) per label)"),
        (IMAGES, 10, "is truncated inside its header (10 bytes, the header alone is 16; its header promises 5 images, "
                     "3936 bytes)"),
        (LABELS, 6, "is truncated inside its header (6 bytes, the header alone is 8)"),
        (IMAGES, 3, "is truncated inside its header (3 bytes, the header alone is 16)"),
    ],
    ids=["empty-images", "empty-labels", "images-cut-in-header", "labels-cut-in-header", "cut-in-magic"],
)
def test_an_empty_or_header_cut_idx_file_is_named_with_its_byte_counts(tmp_path, file, keep, expected):
    """Before: an empty file was 'not an IDX file', one cut inside its header 'holds items of shape ()'."""
    raw = mnist_raw(tmp_path)
    (raw / file).write_bytes((raw / file).read_bytes()[:keep])
    with pytest.raises(DataError) as err:
        load_pool("mnist", str(tmp_path))
    assert str(err.value) == f"mnist: {raw / file} {expected}: replace it"


def test_an_idx_file_whose_header_promises_no_items_is_empty(tmp_path):
    raw = mnist_raw(tmp_path)
    (raw / "t10k-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x0803, 0, 28, 28))
    (raw / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x0801, 0))
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte is empty: its header says it holds no images \(16 bytes\)"):
        load_pool("mnist", str(tmp_path))


# ---- data files: a file where a folder is expected --------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "file", "holds"),
    [
        ("mnist", "data", " (dataset.data_dir, or $FEDCLUSTER_DATA_DIR: the folder that holds MNIST/raw/)"),
        ("mnist", "data/MNIST", ""),
        ("mnist", "data/MNIST/raw", ""),
        ("cifar10", "data", " (dataset.data_dir, or $FEDCLUSTER_DATA_DIR: the folder that holds cifar-10-batches-py/)"),
        ("cifar10", "data/cifar-10-batches-py", ""),
        ("femnist", "data", " (dataset.data_dir, or $FEDCLUSTER_DATA_DIR: the folder that holds femnist/)"),
    ],
)
def test_a_file_where_a_data_folder_belongs_is_named_as_a_file(tmp_path, dataset, file, holds):
    """Before: 'missing ... (the data folder does not exist)', or the files inside it missing."""
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text("not a folder")
    with pytest.raises(DataError) as err:
        load_pool(dataset, str(tmp_path / "data"))
    assert str(err.value) == f"{dataset}: {tmp_path / file} is a file, expected a folder{holds}"


def test_a_devices_data_dir_that_is_a_file_is_named_as_a_file(tmp_path):
    (tmp_path / "device").write_text("")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'device'}: is a file, expected a folder \(data-dir of this SuperNode"):
        load_device_data(tmp_path / "device", InputFormat.builtin("digits"))


def test_a_data_dir_that_is_a_file_is_one_line_before_the_run_starts(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").write_text("")
    code, err = fedcluster(["run", str(MNIST_CONFIG), "--set", f"dataset.data_dir={tmp_path / 'data'}",
                            "--out", str(tmp_path / "out")], capsys, monkeypatch)
    assert code == 2 and f"{tmp_path / 'data'} is a file, expected a folder" in one_error_line(err)


# ---- data files: CIFAR-10's python batches ------------------------------------------------------------


class Planted:
    """A pickle that, loaded by ``pickle.load``, calls ``function(argument)``."""

    def __init__(self, function: Any, argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return self.function, (self.argument,)


@pytest.mark.parametrize("where", ["the batch", "inside the batch's dict"])
@pytest.mark.parametrize("call", ["exec", "os.system"])
def test_a_cifar_batch_whose_pickle_would_write_a_file_is_refused_unrun(tmp_path, capsys, monkeypatch, call, where):
    """Before: pickle.load ran the call (the file was written), then said the file was not a batch."""
    write_cifar(tmp_path / "data", per_batch=2)
    target = tmp_path / "written-by-the-pickle"
    planted = (Planted(exec, f"open({str(target)!r}, 'w').write('ran')") if call == "exec"
               else Planted(os.system, f"touch '{target}'"))
    batch = tmp_path / "data" / "cifar-10-batches-py" / "data_batch_1"
    payload = planted if where == "the batch" else {"data": np.zeros((2, 3072), np.uint8), "labels": [1, 2], "filenames": [planted]}
    batch.write_bytes(pickle.dumps(payload, protocol=2))

    with pytest.raises(DataError) as err:
        load_pool("cifar10", str(tmp_path / "data"))
    asked = r"(__builtin__|builtins)\.exec" if call == "exec" else r"(posix|nt|os)\.system"  # as pickled: Python 2's names
    assert re.fullmatch(rf"cifar10: {re.escape(str(batch))} is not a CIFAR-10 python batch: it asks for {asked}, "
                        r"which a CIFAR-10 batch never holds \(refused unrun\); replace it", str(err.value)), str(err.value)
    assert not target.exists()

    code, err = fedcluster(["run", str(DEFAULT_CONFIG), "--set", "dataset.name=cifar10", "--set", "model.name=lenet_cifar",
                            "--set", f"dataset.data_dir={tmp_path / 'data'}", "--out", str(tmp_path / "out")],
                           capsys, monkeypatch)
    assert code == 2 and str(batch) in one_error_line(err)
    assert not target.exists()


def python2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A batch as the official CIFAR-10 files hold it: a Python 2 cPickle (protocol 2) of a dict
    whose strings are Python 2 ``str`` and whose array numpy pickled through
    ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray`` and ``numpy.dtype``."""
    def text(raw: bytes) -> bytes:  # SHORT_BINSTRING or BINSTRING: a Python 2 str
        return b"U" + bytes([len(raw)]) + raw if len(raw) < 256 else b"T" + struct.pack("<i", len(raw)) + raw

    rows, width = data.shape
    blob = b"\x80\x02}q\x01(" + text(b"data")
    blob += b"cnumpy.core.multiarray\n_reconstruct\nq\x02cnumpy\nndarray\nq\x03K\x00\x85" + text(b"b") + b"\x87R"
    blob += b"(K\x01M" + struct.pack("<H", rows) + b"M" + struct.pack("<H", width) + b"\x86"
    blob += b"cnumpy\ndtype\n" + text(b"u1") + b"K\x00K\x01\x87R(K\x03" + text(b"|")
    blob += b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89" + text(data.tobytes()) + b"tb"
    blob += text(b"labels") + b"](" + b"".join(b"K" + bytes([label]) for label in labels) + b"e"
    return blob + text(b"batch_label") + text(b"training batch 1 of 5") + b"u."


def test_the_official_python2_batches_still_load(tmp_path):
    """The restriction keeps the real format: a guard that the allowed names are the ones the
    official batches use (it passed before the restriction too)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(len(CIFAR_BATCHES), 3, 3072), dtype=np.uint8)
    for k, name in enumerate(CIFAR_BATCHES):
        (folder / name).write_bytes(python2_batch(data[k], [k, 9 - k, 5]))
    pool = load_pool("cifar10", str(tmp_path))
    np.testing.assert_array_equal(pool.images.numpy(), data.reshape(-1, 3, 32, 32))
    assert pool.labels.tolist() == [v for k in range(len(CIFAR_BATCHES)) for v in (k, 9 - k, 5)]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"data": np.zeros((2, 3072), np.uint8), "labels": [3, 10]}, "holds label 10 (item 1, one of 1 outside the classes)"),
        ({"data": np.zeros((2, 3072), np.uint8), "labels": [3, -1]}, "holds label -1 (item 1, one of 1 outside the classes)"),
        ({"data": np.full((2, 3072), 300, np.int64), "labels": [3, 4]}, "is not a CIFAR-10 python batch (data: expected 8-bit pixels"),
        ({"data": np.zeros((2, 3072), np.uint8), "labels": [3]}, "is not a CIFAR-10 python batch (labels: expected 2 integers"),
    ],
    ids=["label-10", "label-minus-1", "pixels-beyond-255", "a-label-missing"],
)
def test_a_cifar_batch_with_labels_or_pixels_outside_the_format_names_the_batch(tmp_path, entry, expected):
    """Before: label 10 was taken for a class, pixel 300 wrapped round to 44, a missing label shifted the rest."""
    write_cifar(tmp_path, per_batch=2)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(pickle.dumps(entry, protocol=2))
    with pytest.raises(DataError) as err:
        load_pool("cifar10", str(tmp_path))
    assert str(err.value).startswith(f"cifar10: {batch} {expected}")


@pytest.mark.parametrize(("labels", "expected"), [
    ([3, 62], "user w1 holds label 62 (item 1, one of 1 outside the classes); the dataset's classes are 0..61"),
    ([3, 2.5], "is not a LEAF FEMNIST file (user w1: labels must be integers, got float64 of shape (2,))"),
])
def test_femnist_labels_outside_its_62_classes_name_the_json_file(tmp_path, labels, expected):
    (tmp_path / "femnist" / "train").mkdir(parents=True)
    path = tmp_path / "femnist" / "train" / "part.json"
    path.write_text(json.dumps({"users": ["w1"], "num_samples": [2], "user_data": {"w1": {"x": [[0.5] * 784] * 2, "y": labels}}}))
    with pytest.raises(DataError) as err:
        load_pool("femnist", str(tmp_path))
    assert expected in str(err.value) and str(path) in str(err.value)


# ---- one run per folder -------------------------------------------------------------------------------


def _contend(config: Any, run_dir: Path, tag: str, barrier: Any, report: Path) -> None:
    """One of two runs released together on one folder, as ``fedcluster run`` goes: its preflight
    (which claims the folder), then the recorder the engine starts, three rounds logged."""
    code = 1
    try:
        barrier.wait(timeout=30)
        runner.preflight(config, run_dir)
        recorder = RunRecorder(run_dir)
        recorder.start({**config_to_dict(config), "tag": tag})
        for server_round in (1, 2, 3):
            recorder.log_round({"round": server_round, "tag": tag})
        code = 0
    except ConfigError as err:
        report.write_text(f"error: {err}\n")
        code = 2
    finally:
        os._exit(code)


def test_two_runs_released_together_on_one_folder_exactly_one_runs(tmp_path):
    """Before: both got through the check of an empty folder and wrote their rows into one
    rounds.jsonl (81 times in 100)."""
    config = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=3", "strategy.rounds_before_clustering=1")])[0]
    Experiment(config).data()  # loaded once here, inherited by the forked runs: they meet at the claim
    context = multiprocessing.get_context("fork")
    for attempt in range(8):
        run_dir = tmp_path / f"out{attempt}"
        barrier = context.Barrier(2)
        runs = {tag: context.Process(target=_contend, args=(config, run_dir, tag, barrier, tmp_path / f"{attempt}{tag}.err"))
                for tag in ("a", "b")}
        for process in runs.values():
            process.start()
        for process in runs.values():
            process.join(timeout=60)
        codes = {tag: process.exitcode for tag, process in runs.items()}
        assert sorted(codes.values()) == [0, 2], codes
        (winner,) = [tag for tag, code in codes.items() if code == 0]
        (loser,) = [tag for tag, code in codes.items() if code == 2]
        rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
        assert rows == [{"round": r, "tag": winner} for r in (1, 2, 3)]
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["tag"] == winner
        message = one_error_line((tmp_path / f"{attempt}{loser}.err").read_text())
        assert message.startswith(f"error: --out: {run_dir} ") or message.startswith(f"error: {run_dir}: "), message
        assert "claimed by another run" in message or "already holds files" in message, message


def test_a_folder_claimed_by_another_run_is_refused_without_a_write(tmp_path):
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    (run_dir / CLAIM_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00"}))
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(ConfigError, match=rf"^{run_dir}: claimed by another run \(pid 1 on elsewhere, since 2026-01-01T00:00:00\)"):
        RunRecorder(run_dir).start({})
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_a_folder_claimed_by_a_run_that_ended_before_writing_says_so(tmp_path, capsys, monkeypatch):
    """A run stopped between its claim and its first file (Ctrl-C while starting) leaves only the
    hidden claim: the folder is refused, naming the claim to delete, not said to hold files."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    (run_dir / CLAIM_FILE).write_text(json.dumps({"pid": int(ended.stdout), "host": socket.gethostname(), "started": "T"}))
    code, err = fedcluster(["run", str(DEFAULT_CONFIG), "--out", str(run_dir)], capsys, monkeypatch)
    assert code == 2 and one_error_line(err) == (
        f"error: --out: {run_dir} was claimed by a run (pid {int(ended.stdout)} on {socket.gethostname()}, since T) that has "
        f"ended without writing anything else (stopped while starting); give a new directory, or delete "
        f"{run_dir / CLAIM_FILE} to use this one")


@pytest.mark.slow
def test_two_fedcluster_runs_started_together_on_one_out_one_exits_0(tmp_path):
    """The command line itself, three times: two ``fedcluster run`` processes on one ``--out``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        command = [sys.executable, "-m", "fedcluster_flwr.cli", "run", str(DEFAULT_CONFIG), "--out", str(out), "--no-progress",
                   "--set", "rounds=2", "--set", "strategy.rounds_before_clustering=1", "--set", "simulation.engine=inprocess"]
        runs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
        results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
        assert sorted(code for code, _ in results) == [0, 2], results
        (err,) = [err for code, err in results if code == 2]
        assert str(out) in one_error_line(err)
        rows = [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()]
        assert rows == [1, 2]


# ---- resume: the file that disagrees is named ----------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A small FL+HC run on digits stopped after round 2, the round it clustered in."""
    overrides = ("rounds=3", "strategy.rounds_before_clustering=1", "partition.num_clients=8", "client.epochs=1")
    config = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    run_in_process(config, run_dir, stop_after=2)
    return run_dir


def edited_copy(run: Path, tmp_path: Path, state: str | None = None, config: str | None = None,
                summary_names_it: bool = True) -> Path:
    """A copy of ``run`` whose checkpoint/state.json names strategy ``state``, whose config.yaml
    names ``config`` (each if given), and whose summary.json names none unless ``summary_names_it``."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    if state is not None:
        written = json.loads((copy / "checkpoint" / "state.json").read_text())
        written["strategy"]["strategy"] = state
        (copy / "checkpoint" / "state.json").write_text(json.dumps(written))
    if config is not None:
        written = yaml.safe_load((copy / "config.yaml").read_text())
        written["strategy"] = {"name": config}
        (copy / "config.yaml").write_text(yaml.safe_dump(written, sort_keys=False))
    if not summary_names_it:
        written = json.loads((copy / "summary.json").read_text())
        del written["strategy"]
        (copy / "summary.json").write_text(json.dumps(written))
    return copy


def files_of(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_state_json_edited_to_another_strategy_is_blamed_not_config_yaml(stopped_run, tmp_path, capsys, monkeypatch):
    """Before: 'config.yaml: strategy.name is flhc, but the checkpoint was written by fedavg: restore
    strategy.name: fedavg' -- which then ran a "fedavg" carrying FL+HC's three clusters."""
    run = edited_copy(stopped_run, tmp_path, state="fedavg")
    before = files_of(run)
    code, err = fedcluster(["resume", str(run)], capsys, monkeypatch)
    assert code == 2
    assert one_error_line(err) == (
        f"error: {run / 'checkpoint' / 'state.json'}: names strategy fedavg, but the run's config.yaml and summary.json "
        "name flhc: the checkpoint was edited or comes from another run; put the run's own checkpoint/ back "
        "(a checkpoint is never continued under another strategy's name)")
    assert files_of(run) == before


def test_the_advice_followed_both_edited_files_are_still_refused(stopped_run, tmp_path, capsys, monkeypatch):
    """config.yaml changed to agree with the edited state.json: summary.json still says FL+HC ran,
    and the resume does not continue FL+HC's clusters as fedavg."""
    run = edited_copy(stopped_run, tmp_path, state="fedavg", config="fedavg")
    code, err = fedcluster(["resume", str(run)], capsys, monkeypatch)
    assert code == 2
    assert one_error_line(err) == (
        f"error: {run / 'summary.json'}: records that the run was flhc, but its config.yaml and checkpoint/state.json name "
        "fedavg: both were edited (restore them), or summary.json was (a checkpoint is never continued under another "
        "strategy's name)")


def test_a_config_yaml_edited_to_another_strategy_is_still_blamed(stopped_run, tmp_path, capsys, monkeypatch):
    run = edited_copy(stopped_run, tmp_path, config="fedavg")
    code, err = fedcluster(["resume", str(run)], capsys, monkeypatch)
    assert code == 2 and one_error_line(err).startswith(
        f"error: {run / 'config.yaml'}: strategy.name is fedavg, but the checkpoint was written by flhc: restore strategy.name: flhc")


def test_without_a_summary_to_tell_both_disagreeing_files_are_named(stopped_run, tmp_path, capsys, monkeypatch):
    """Before: config.yaml was blamed and the checkpoint's strategy advised, with nothing to tell which was edited."""
    run = edited_copy(stopped_run, tmp_path, state="fedavg", summary_names_it=False)
    code, err = fedcluster(["resume", str(run)], capsys, monkeypatch)
    assert code == 2
    assert one_error_line(err) == (
        f"error: {run / 'config.yaml'}: strategy.name is flhc, but {run / 'checkpoint' / 'state.json'} names fedavg and "
        "summary.json does not say which ran: restore the edited file, or start a new run (a checkpoint is never "
        "continued under another strategy's name)")


# ---- replies: one per client per round ----------------------------------------------------------------


def test_a_second_reply_from_one_client_is_refused_counted_and_never_averaged(tmp_path):
    """Before: aggregate_fit averaged both replies of client 0 (5 replies from 4 clients sent work),
    and its second evaluation result replaced its first."""
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 4, rounds=2))
    connect_test_run(strategy)
    manager = synthetic_grid(4)
    sent = configure(strategy, 1, manager)
    assert len(sent) == 4
    replies = [reply_to(message, fit_res(constant_model(1.0))) for message in sent]
    replies.append(reply_to(sent[0], fit_res(constant_model(50.0))))  # the same client again, later
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["accepted_updates"] == 4 and strategy.counters.rejected_updates == 1
    np.testing.assert_array_equal(strategy.models[0][0], constant_model(1.0)[0])

    def evaluation(message, loss, accuracy):
        return reply_to(message, RecordDict({METRICS: metrics_record({ACCURACY: accuracy, TEST_LOSS: loss, NUM_EXAMPLES: 5})}))

    evaluations = strategy.configure_evaluate(1, None, None, manager)
    answers = [evaluation(message, 0.5, 0.8) for message in evaluations] + [evaluation(evaluations[0], 9.0, 0.1)]
    strategy.aggregate_evaluate(1, answers)
    (row,) = recorded_rows(strategy)
    assert row["num_fit_clients"] == 4 and row["rejected_updates"] == 1
    assert row["num_evaluated"] == 4 and row["eval_failures"] == 1
    assert row["client_accuracy"] == {str(p): 0.8 for p in range(4)}


def test_a_reply_in_a_later_round_does_not_count_against_the_first(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 2, rounds=2))
    connect_test_run(strategy)
    manager = synthetic_grid(2)
    for server_round in (1, 2):
        sent = configure(strategy, server_round, manager)
        _, metrics = strategy.aggregate_train(server_round, [reply_to(m, fit_res(constant_model(1.0))) for m in sent])
        assert metrics["accepted_updates"] == 2 and strategy.counters.rejected_updates == 0


def test_a_client_sent_work_that_never_answers_is_a_failure(tmp_path):
    """On a grid with a round timeout, a reply that does not come back in time is simply missing."""
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3, rounds=2))
    connect_test_run(strategy)
    sent = configure(strategy, 1, synthetic_grid(3))
    _, metrics = strategy.aggregate_train(1, [reply_to(sent[0], fit_res(constant_model(1.0)))])
    assert metrics["accepted_updates"] == 1 and metrics["fit_failures"] == 2


# ---- instructions: a malformed one is one line naming the key -------------------------------------------


@pytest.fixture(scope="module")
def digits_weights():
    config = load_config(DEFAULT_CONFIG, [])[0]
    client = Experiment(config).client(0, config.partition.num_clients)
    return [a.detach().numpy().copy() for a in client.model_factory().state_dict().values()]


@pytest.mark.parametrize(
    ("server_round", "expected"),
    [
        (None, "instruction's 'server-round' must be a round number (an integer >= 1), got None"),
        ("3", "instruction's 'server-round' must be a round number (an integer >= 1), got '3'"),
        (0, "instruction's 'server-round' must be a round number (an integer >= 1), got 0"),
        (-2, "instruction's 'server-round' must be a round number (an integer >= 1), got -2"),
        (2.5, "instruction's 'server-round' must be a round number (an integer >= 1), got 2.5"),
        (True, "instruction's 'server-round' must be a round number (an integer >= 1), got True"),
    ],
    ids=["no-round", "round-text", "round-0", "round-negative", "round-fraction", "round-bool"],
)
@pytest.mark.parametrize("task", [TRAIN, EVALUATE], ids=lambda t: t.name)
def test_an_instruction_without_a_round_or_with_a_bad_one_is_one_line_naming_it(digits_weights, task, server_round, expected):
    """Before: a KeyError or ValueError of int(), a round 0 or 2.5 taken as given, a missing
    evaluation round read as 0."""
    content = task.instruction({MODEL: [digits_weights]}, {}, 3)
    config = dict(content[CONFIG]) | {ROUND_KEY: server_round}
    content[CONFIG] = ConfigRecord({k: v for k, v in config.items() if v is not None})
    with pytest.raises(ProtocolError) as err:
        task.read_instruction(content)
    assert str(err.value) == expected and "\n" not in str(err.value)


def test_a_run_stopped_while_starting_gives_up_its_claim_so_the_same_command_starts_it_again(tmp_path):
    from fedcluster_flwr.results.recorder import CLAIM_FILE, check_run_dir_free, claim_run_dir, release_unused_claim

    started = tmp_path / "stopped_while_starting"
    claim_run_dir(started)
    release_unused_claim(started)
    assert not started.exists()
    check_run_dir_free(started)  # free again
    written = tmp_path / "wrote_rounds"
    claim_run_dir(written)
    (written / "rounds.jsonl").write_text("")
    release_unused_claim(written)  # a run that wrote something keeps its folder and its claim
    assert (written / CLAIM_FILE).is_file()
