"""Careless and hostile configs (issue #42): what a config cannot mean is refused in one line naming
the key, quickly, before anything runs; a run's cost is said before it starts; a stop signal at any
instant of ``fedcluster`` gives its exit code and one line; output that cannot be written is found
before the data are read; Flower's telemetry is off wherever this project starts Flower.

Where today's code would run away on a test's input (a billion laughs expands for 38 s into GBs,
a 26 MB list for 148 s), a small input of the same kind is asserted on first, so that the old
behaviour fails the test at once instead of exhausting the machine.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr import runner
from fedcluster_flwr.cli import console
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override
from fedcluster_flwr.declarations.options import from_mapping
from fedcluster_flwr.declarations.schema import ConfigError, Interval, above, option

# Modules this issue added are imported where they are used, so that on the code before it each
# test fails on its own assertion rather than all of them on an import.


def fedcluster(capsys, *argv: str) -> tuple[int, str, str]:
    """``fedcluster ARGV`` in this process: its exit code, stdout and stderr."""
    code = console.main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


MODEL = "model:\n  name: mlp_digits\n"


# ---- keys given twice ----------------------------------------------------------------------------


def test_a_key_given_twice_is_an_error_naming_it_and_both_lines(tmp_path, capsys):
    config = write(tmp_path / "twice.yaml", MODEL + "client:\n  lr: 0.1\n  epochs: 2\n\n  lr: 5\n")
    code, _, err = fedcluster(capsys, "run", str(config))
    assert code == 2
    assert one_error_line(err) == (f"error: client.lr: given twice; YAML would keep the last without a word: "
                                   f"keep one ({config}, lines 4 and 7)")


@pytest.mark.parametrize(("text", "key", "where"), [
    ("model: {name: mlp_digits, name: cnn_digits}\n", "model.name", "line 1, columns 9 and 27"),
    (MODEL + "simulation:\n  fail_fit:\n    1: [2]\n    0x1: [3]\n", "simulation.fail_fit.1", "lines 5 and 6"),  # one int
    (MODEL + "partition:\n  name: label_swap\n  swaps: [[0, 1], {a: 1, a: 2}]\n", "partition.swaps[1].a", "line 5"),
])
def test_a_key_given_twice_is_found_in_flow_style_as_the_same_value_and_inside_lists(tmp_path, text, key, where):
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path / "c.yaml", text))
    assert raised.value.key == key and where in raised.value.message


def test_a_key_given_twice_in_a_set_value_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"^strategy\.threshold: given twice"):
        load_config(DEFAULT_CONFIG, [parse_override("strategy={name: flhc, threshold: 1, threshold: 2}")])


# ---- aliases, nesting, size ----------------------------------------------------------------------


def laughs(levels: int, width: int) -> str:
    """The "billion laughs": each level a list of ``width`` aliases of the level below."""
    lines = ['a: &a ["lol", "lol"]']
    for level in range(1, levels):
        name, below = chr(ord("a") + level), chr(ord("a") + level - 1)
        lines.append(f"{name}: &{name} [{', '.join([f'*{below}'] * width)}]")
    return MODEL + "\n".join(lines) + "\n"


def test_aliases_are_refused_at_the_first_one_so_no_bomb_expands(tmp_path, capsys):
    small = write(tmp_path / "small.yaml", laughs(levels=4, width=3))  # today's code expands it in ms
    with pytest.raises(ConfigError, match=r"^b\[0\]: is the YAML alias \*a; a config takes no anchors or aliases"):
        load_config(small)
    bomb = write(tmp_path / "laughs.yaml", laughs(levels=10, width=9))  # 9**9 leaves: ~1e9
    assert bomb.stat().st_size < 1_300
    started = time.perf_counter()
    with pytest.raises(ConfigError):
        load_config(bomb)
    assert time.perf_counter() - started < 1.0
    code, _, err = fedcluster(capsys, "run", str(bomb))
    assert code == 2 and one_error_line(err).endswith(f"({bomb}, line 4)")


@pytest.mark.parametrize(("text", "key"), [
    ("model: &m\n  name: mlp_digits\n  inner: *m\n", "model.inner"),  # today: RecursionError in config._deep_copy
    (MODEL + "base: &base {lr: 0.1}\nclient:\n  <<: *base\n", "client.<<"),  # a merge key is an alias too
])
def test_an_alias_that_holds_itself_or_a_merge_key_is_refused_naming_where(tmp_path, text, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: is the YAML alias"):
        load_config(write(tmp_path / "alias.yaml", text))


def test_an_alias_in_a_set_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^simulation\.fail_fit\.3\[1\]: is the YAML alias \*x"):
        parse_override("simulation.fail_fit={3: [1, *x]}")


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path, capsys):
    over = write(tmp_path / "over.yaml", "[" + " " * 256_000)  # today: "not valid YAML", at once
    with pytest.raises(ConfigError, match=rf"^config: {re.escape(str(over))} is 256,001 bytes; a config file is at most 256,000 "):
        load_config(over)
    big = tmp_path / "big.yaml"  # the 26 MB list today's code read for 148 s into a MemoryError
    with open(big, "w") as handle:
        handle.write("x: [")
        handle.writelines("1," * 1_000_000 for _ in range(13))
        handle.write("1]\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError):
        load_config(big)
    assert time.perf_counter() - started < 1.0
    code, _, err = fedcluster(capsys, "run", str(big))
    assert code == 2 and "big.yaml is 26,000,007 bytes; a config file is at most 256,000 (a few thousand" in one_error_line(err)


def test_nesting_deeper_than_any_config_is_refused(tmp_path):
    deep = write(tmp_path / "deep.yaml", MODEL + "x: " + "[" * 25 + "]" * 25 + "\n")  # today: a ConfigError on x
    with pytest.raises(ConfigError, match=r"^config: nested more than 20 levels deep.*line 3\)$"):
        load_config(deep)


def test_a_binary_file_or_a_device_is_named_as_such(tmp_path):
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"model:\n  name: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"^config: {re.escape(str(binary))} is not a text file \(byte 15 is not UTF-8\)$"):
        load_config(binary)
    if Path("/dev/zero").exists():  # today: read for ever
        with pytest.raises(ConfigError, match=r"^config: /dev/zero is not a regular file"):
            load_config("/dev/zero")


# ---- numbers: finite, within what the libraries take ---------------------------------------------


@pytest.mark.parametrize(("override", "message"), [
    ("strategy.threshold=.inf", "strategy.threshold: must be a finite number, got inf"),
    ("strategy.threshold=1e309", "strategy.threshold: must be a finite number, got inf"),  # YAML reads it as inf
    ("client.lr=.nan", "client.lr: must be in (0, 1e+37], got nan (at most 1e37: Adam's first step, 10·lr, must be a "
                       "float32 number, as the parameters are)"),  # its declared bound comes first
    ("client.weight_decay=.inf", "client.weight_decay: must be in [0, 1e+37], got inf (at most 1e37: it multiplies "
                                 "the float32 parameters in every step)"),
    ("partition.val_fraction=.nan", "partition.val_fraction: must be a finite number, got nan"),  # no declared constraint
    ("simulation.round_timeout_s=.inf", "simulation.round_timeout_s: must be a finite number, got inf"),
    ("strategy.threshold=-.inf", "strategy.threshold: must be > 0, got -inf"),
])
def test_every_float_option_is_finite(override, message):
    with pytest.raises(ConfigError) as raised:
        load_config(DEFAULT_CONFIG, [parse_override(override)])
    assert str(raised.value) == message


def test_a_non_finite_number_in_a_list_is_named_with_its_place():
    with pytest.raises(ConfigError, match=r"^partition\.angles: must be a finite number, got inf at \[1\]$"):
        load_config(ROOT / "conf" / "dac_fmnist_rot4.yaml", [parse_override("partition.angles=[0, .inf, 180, 270]")])


def test_a_non_finite_lr_in_a_file_is_refused_naming_client_lr(tmp_path, capsys):
    code, _, err = fedcluster(capsys, "run", str(write(tmp_path / "lr.yaml", MODEL + "client:\n  lr: 1e309\n")))
    assert code == 2 and one_error_line(err) == ("error: client.lr: must be in (0, 1e+37], got inf (at most 1e37: Adam's "
                                                 "first step, 10·lr, must be a float32 number, as the parameters are)")


@dataclass(frozen=True)
class Declared:
    finite: float = option(1.0, above(0))
    infinite_allowed: float = option(1.0, Interval(0, math.inf))  # the declaration that admits inf


def test_finiteness_is_implied_by_the_declarations_unless_an_interval_admits_infinity():
    assert from_mapping(Declared, {"infinite_allowed": math.inf}).infinite_allowed == math.inf
    with pytest.raises(ConfigError, match=r"^x\.finite: must be a finite number, got inf$"):
        from_mapping(Declared, {"finite": math.inf}, "x")
    with pytest.raises(ConfigError, match=r"^x\.infinite_allowed: must be in \[0, inf\], got nan$"):
        from_mapping(Declared, {"infinite_allowed": math.nan}, "x")


@pytest.mark.parametrize("key", ["seed", "faults.seed"])
def test_a_seed_is_bounded_where_the_libraries_it_reaches_are(key):
    with pytest.raises(ConfigError) as raised:  # today: OverflowError in torch.manual_seed
        load_config(DEFAULT_CONFIG, [(key, 2**64)])
    assert str(raised.value) == f"{key}: must be in [0, 4294967295], got 18446744073709551616"
    config, _ = load_config(DEFAULT_CONFIG, [(key, 2**32 - 1)])
    assert (config.seed if key == "seed" else config.faults.seed) == 2**32 - 1


def test_the_largest_seed_is_one_every_library_takes_and_the_next_is_not():
    from sklearn.random_projection import SparseRandomProjection

    largest = 2**32 - 1
    torch.manual_seed(largest)
    np.random.SeedSequence([largest, 30, 19]).generate_state(1)
    SparseRandomProjection(n_components=2, random_state=largest).fit(np.zeros((1, 8)))  # FL+HC's projection
    with pytest.raises(ValueError):
        SparseRandomProjection(n_components=2, random_state=largest + 1).fit(np.zeros((1, 8)))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("rounds", 2**63, "rounds: must fit in 64 bits (at most 2**63 - 1), got 9223372036854775808"),
    ("simulation.fail_fit", {3: [1, 2**70]}, "simulation.fail_fit: must fit in 64 bits (at most 2**63 - 1), "
                                             "got 1180591620717411303424 at 3[1]"),
    ("partition.num_clients", 10**9, "partition.num_clients: must be in [1, 1000000], got 1000000000"),
])
def test_integer_options_are_bounded(key, value, message):
    with pytest.raises(ConfigError) as raised:  # num_clients=10**9: today 40 s of allocation first
        load_config(DEFAULT_CONFIG, [(key, value)])
    assert str(raised.value) == message


# ---- what a run will cost ------------------------------------------------------------------------


@pytest.fixture
def no_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the run was started")

    monkeypatch.setattr(runner, "run_experiment", refuse)


def test_a_run_far_longer_than_any_experiment_warns_what_it_will_cost(capsys, no_run, tmp_path):
    code, _, err = fedcluster(capsys, "run", str(DEFAULT_CONFIG), "--set", "client.epochs=1000000000", "--dry-run")
    assert code == 0
    assert err.startswith("warning: a very long run: about 1.29e+13 client-sample passes: rounds 30 x 6 clients "
                          "a round (partition.num_clients, strategy.client_fraction) x client.epochs 1000000000 x ~72 "
                          "training samples per client; 5e+08 times conf/default.yaml")
    assert len(err.strip().splitlines()) == 1


def test_dry_run_prints_the_resolved_config_and_its_cost_and_runs_nothing(capsys, no_run, tmp_path):
    code, out, err = fedcluster(capsys, "run", str(DEFAULT_CONFIG), "--set", f"output_dir={tmp_path}", "--dry-run")
    assert code == 0 and err == ""
    resolved, _ = load_config(DEFAULT_CONFIG, [("output_dir", str(tmp_path))])
    assert yaml.safe_load(out) == config_to_dict(resolved)  # the output is a config file that runs as this run would
    assert out.splitlines()[-1].startswith("# cost: about 2.59e+04 client-sample passes: rounds 30 x 6 clients a round")
    assert list(tmp_path.iterdir()) == []


def test_the_cost_of_the_default_config_is_the_one_messages_compare_with_and_no_shipped_config_warns():
    from fedcluster_flwr.config.cost import DEFAULT_CONFIG_PASSES, WARN_PASSES, estimate_cost

    default, _ = load_config(DEFAULT_CONFIG)
    assert estimate_cost(default).passes == pytest.approx(DEFAULT_CONFIG_PASSES, rel=1e-4)
    for path in sorted((ROOT / "conf").glob("*.yaml")):
        try:
            config, notes = load_config(path)
        except ConfigError:  # one needs pretrained weights on disk
            continue
        assert estimate_cost(config).passes < WARN_PASSES / 10 and not any("very long run" in n for n in notes), path


def test_the_cost_counts_the_clients_a_round_trains_and_the_gossip_strategies_pretraining():
    from fedcluster_flwr.config.cost import estimate_cost

    fedavg, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (
        "strategy.name=fedavg", "strategy.client_fraction=0.25", "partition.num_clients=10", "rounds=4",
        "client.epochs=3", "partition.samples_per_client=50", "partition.test_fraction=0.2")])
    assert estimate_cost(fedavg).passes == pytest.approx(4 * 2 * 3 * 40)  # floor(0.25 * 10) clients of 40 training samples
    dac, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (
        "strategy.name=dac", "strategy.client_fraction=1", "strategy.pretrain_epochs=7", "partition.num_clients=10", "rounds=4",
        "client.epochs=3", "partition.samples_per_client=50", "partition.test_fraction=0.2")])
    assert estimate_cost(dac).passes == pytest.approx(4 * 10 * 3 * 40 + 10 * 7 * 40)


# ---- output that cannot be written ---------------------------------------------------------------


@pytest.fixture
def nothing_started(monkeypatch):
    """Fail the test if the data are read or an engine starts."""
    from fedcluster_flwr.experiment import Experiment

    def refuse(*args, **kwargs):
        raise AssertionError("reached after the output check")

    monkeypatch.setattr(Experiment, "data", refuse)
    monkeypatch.setattr(runner, "_run_in_own_process", refuse)


def test_an_output_folder_under_a_file_is_one_line_before_the_data_are_read(tmp_path, capsys, nothing_started):
    blocker = write(tmp_path / "results", "a file where a folder would be")
    out = blocker / "run"
    code, _, err = fedcluster(capsys, "run", str(DEFAULT_CONFIG), "--out", str(out), "--no-progress")
    assert code == 2
    assert one_error_line(err) == (f"error: --out: {out} cannot hold the results: {blocker} is a file, not a folder; "
                                   "give another directory")
    assert blocker.read_text() == "a file where a folder would be"


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="no /sys (not Linux)")
def test_a_read_only_output_folder_is_one_line_before_the_data_are_read(capsys, nothing_started):
    out = Path("/sys/fedcluster-hostile-test/run")  # sysfs: read-only even for root, whom chmod does not stop
    code, _, err = fedcluster(capsys, "run", str(DEFAULT_CONFIG), "--out", str(out), "--no-progress")
    assert code == 2
    line = one_error_line(err)
    assert line.startswith(f"error: --out: {out} cannot hold the results: cannot create a file in /sys (")
    assert not out.parent.exists()


def test_a_full_disk_is_one_line_before_the_data_are_read_and_leaves_nothing(tmp_path, capsys, nothing_started, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "run"
    code, _, err = fedcluster(capsys, "run", str(DEFAULT_CONFIG), "--out", str(out), "--no-progress")
    assert code == 2
    assert one_error_line(err) == (f"error: --out: {out} cannot hold the results: {tmp_path} is full "
                                   "(No space left on device); give another directory")
    assert list(tmp_path.iterdir()) == []  # not the folder, not the probe


def test_a_disk_that_fills_during_the_run_is_one_line_saying_what_was_kept(tmp_path, monkeypatch):
    """No traceback for a full disk mid-run: the engine tells the supervisor, which says in one line
    what is there (the last checkpoint before the disk filled)."""
    from fedcluster_flwr import run_process as simulation
    from fedcluster_flwr.apps.server_app import run_in_process
    from fedcluster_flwr.results.recorder import RunRecorder

    config, _ = load_config(DEFAULT_CONFIG, [("rounds", 4), ("strategy.name", "fedavg")])
    save = RunRecorder.save_checkpoint

    def fills_at_round_3(self, checkpoint):
        if checkpoint["round"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / "checkpoint" / ".tmp-models"))
        save(self, checkpoint)

    monkeypatch.setattr(RunRecorder, "save_checkpoint", fills_at_round_3)
    run_dir = tmp_path / "run"
    with pytest.raises(OSError) as raised:
        run_in_process(config, run_dir)
    event = simulation.error_event(raised.value)
    assert event["kind"] == simulation.OUTPUT
    message = str(runner.run_process_error(event, run_dir))
    assert message == (f"the results could not be written in {run_dir} (No space left on device); rounds 1-2 are in "
                       f"{run_dir}, checkpointed (fedcluster resume {run_dir} continues them)")
    assert all(path.exists() for path in named_paths(message)), message
    assert simulation.error_event(ValueError("x"))["kind"] == simulation.BUG  # a bug keeps its traceback


def test_a_run_folder_in_use_is_not_continued_beside_its_user_and_a_stale_plan_is_refused(tmp_path, capsys):
    """Two processes never write one run: a resume while another process holds the folder (a run or a
    resume still going) is one line, exit 2, nothing written; a resume planned from a checkpoint that
    moved on before it could start is refused too."""
    from fedcluster_flwr.runner import continue_run, plan_continuation
    import dataclasses as dc

    run = tmp_path / "run"
    code, _, _ = fedcluster(capsys, "run", str(DEFAULT_CONFIG), "--out", str(run), "--set", "rounds=4",
                            "--set", "strategy.name=fedavg", "--set", "simulation.engine=inprocess",
                            "--stop-after", "2", "--no-progress")
    assert code == 0
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        code, _, err = fedcluster(capsys, "resume", str(run), "--no-progress")
        assert code == 2
        assert one_error_line(err) == (f"error: {run}: is in use: another fedcluster process is running or continuing "
                                       "the run there; wait for it to end (or stop it), then try again")
        assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    finally:
        holder.kill()
        holder.wait()
    stale = dc.replace(plan_continuation(run), completed_round=1)
    with pytest.raises(runner.RunFolderTaken, match="no longer round 1; run the command again"):
        continue_run(stale)
    code, _, _ = fedcluster(capsys, "resume", str(run), "--no-progress")
    assert code == 0 and json.loads((run / "summary.json").read_text())["finished"] is True


def named_paths(message: str) -> list[Path]:
    return [Path(token.strip(";,()")) for token in message.split() if token.startswith("/")]


def test_messages_of_a_run_stopped_or_failed_early_name_only_files_that_exist(tmp_path):
    from fedcluster_flwr.results.run_outcome import stop_message, what_was_kept

    never_created = tmp_path / "run"
    for message in (stop_message("SIGINT", never_created), str(runner.Interrupted(signal.SIGINT, never_created)),
                    what_was_kept(never_created)):
        assert all(path.exists() for path in named_paths(message)), message
    assert stop_message("SIGINT", never_created) == "SIGINT: stopped before the run wrote anything; start it again with the same command"
    assert what_was_kept(never_created) == f"nothing was written ({never_created} was not created)"
    never_created.mkdir()
    (never_created / "config.yaml").write_text("seed: 0\n")
    message = stop_message("SIGTERM", never_created)
    assert message.startswith("SIGTERM: stopped before the first checkpoint") and str(never_created / "config.yaml") in message


# ---- stop signals from the first instant ---------------------------------------------------------


def console_script() -> str:
    """What the installed ``fedcluster`` runs: pyproject.toml's entry point, as pip's wrapper calls it."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        module, function = tomllib.load(handle)["project"]["scripts"]["fedcluster"].split(":")
    return f"import sys; from {module} import {function}; sys.exit({function}())"


def test_the_console_script_imports_nothing_heavy_before_it_handles_stop_signals():
    module = console_script().split("from ")[1].split(" import")[0]
    probe = f"import sys, {module}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'flwr', 'numpy', 'yaml'}}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def handles_sigterm(pid: int) -> bool:
    """Whether the process catches SIGTERM (Python does not by default: fedcluster's handler does)."""
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def has_mapped_libtorch(pid: int) -> bool:
    """Whether torch's import has begun loading its C++ library (it goes on for seconds after)."""
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def stop_during_start_up(tmp_path: Path, signum: int, after: float | str) -> tuple[int, str, str]:
    """Start ``fedcluster run conf/default.yaml``, send ``signum`` ``after`` seconds after it began
    (or, on a machine too loaded to have started Python by then, as soon as its handlers are in),
    or with ``after="torch"`` as soon as torch's import is under way, however fast the machine."""
    proc = subprocess.Popen([sys.executable, "-c", console_script(), "run", str(DEFAULT_CONFIG), "--out",
                             str(tmp_path / "run"), "--no-progress"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    try:
        while not handles_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() - started < 30, "no handler installed"
            time.sleep(0.01)
        while after == "torch" and not has_mapped_libtorch(proc.pid):
            assert proc.poll() is None and time.monotonic() - started < 30, "torch never loaded"
            time.sleep(0.005)
        time.sleep(0.0 if after == "torch" else max(0.0, after - (time.monotonic() - started)))
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
@pytest.mark.parametrize(("signum", "after"), [
    (signal.SIGINT, 0.3),
    (signal.SIGTERM, 0.3),
    # inside torch's import (a fixed 1.5 s was sometimes past the whole import, about 2 s here)
    (signal.SIGINT, "torch"),
])
def test_a_stop_signal_while_fedcluster_starts_gives_its_exit_code_and_one_line(tmp_path, signum, after):
    code, out, err = stop_during_start_up(tmp_path, signum, after)
    assert code == 128 + signum, err
    assert "Traceback" not in out + err
    assert err.strip().splitlines() == [f"{signal.Signals(signum).name}: fedcluster stopped while starting; nothing was run"]
    assert not (tmp_path / "run").exists()


def test_a_stop_signal_outside_a_run_is_one_line_in_process(capsys, monkeypatch):
    from fedcluster_flwr.cli import commands

    def stop_while_loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (the main) thread at once
        time.sleep(5)
        raise AssertionError("the signal was not handled")

    monkeypatch.setattr(commands, "load_config", stop_while_loading)
    previous = signal.getsignal(signal.SIGTERM)
    code, _, err = fedcluster(capsys, "run", str(DEFAULT_CONFIG))
    assert code == 143
    assert err == "SIGTERM: fedcluster stopped outside a run (none was interrupted); nothing is left running\n"
    assert signal.getsignal(signal.SIGTERM) is previous  # the caller's handler is back


# ---- Flower's telemetry and update check, Ray's usage statistics -----------------------------------

FLOWER_QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
QUIET = FLOWER_QUIET | {"RAY_USAGE_STATS_ENABLED": "0"}  # nothing leaves the machine unasked


def test_the_tests_run_with_flowers_telemetry_and_update_check_off():
    import flwr.supercore.telemetry as telemetry

    assert {name: os.environ[name] for name in QUIET} == QUIET
    assert telemetry.FLWR_TELEMETRY_ENABLED == "0"  # what Flower read when it was imported


@pytest.mark.parametrize("variable", QUIET)
@pytest.mark.parametrize("given", [None, "set"])
def test_fedcluster_turns_flowers_telemetry_and_update_check_off_unless_the_user_set_them(variable, given):
    env = {k: v for k, v in os.environ.items() if k not in QUIET}
    users = {"FLWR_TELEMETRY_ENABLED": "1", "FLWR_DISABLE_UPDATE_CHECK": "0", "RAY_USAGE_STATS_ENABLED": "1"}[variable]
    if given is not None:
        env[variable] = users
    probe = f"import os, fedcluster_flwr; print(os.environ[{variable!r}])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**env, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == (QUIET[variable] if given is None else users), done.stderr


def test_ci_the_docs_and_every_benchmark_that_runs_flower_keep_it_quiet():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for name, value in QUIET.items():
        exported = ci.index(f"export {name}={value}")
        assert all(exported < k for k, line in enumerate(ci) if "pytest" in line and not line.startswith("#"))
    for script in sorted((ROOT / "benchmarks").rglob("*.py")):
        text = script.read_text()
        if re.search(r"run_experiment|fedcluster_flwr\.cli\b|run_simulation", text):
            sets_it = 'os.environ["FLWR_TELEMETRY_ENABLED"] = "0"' in text  # the update check: fedcluster_flwr's import
            assert sets_it or re.search(r"^(from common import|import common)", text, flags=re.M), script
    for page, named in (("README.md", QUIET), ("docs/how-to/flwr-run.md", QUIET), ("docs/how-to/deploy.md", FLOWER_QUIET),
                        ("deploy/Dockerfile", FLOWER_QUIET)):  # a deployment starts no Ray
        text = (ROOT / page).read_text()
        assert all(f"{name}={value}" in text for name, value in named.items()), page


# ---- the docs' table -----------------------------------------------------------------------------


def test_the_robustness_page_shows_the_messages_the_code_gives(tmp_path):
    """docs/reference/robustness.md's table of this file's inputs quotes what the code prints."""
    page = (ROOT / "docs" / "reference" / "robustness.md").read_text()

    def message(path_or_none, *overrides) -> str:
        with pytest.raises(ConfigError) as raised:
            load_config(path_or_none, [parse_override(o) if isinstance(o, str) else o for o in overrides])
        return str(raised.value).replace(str(tmp_path), "<tmp>")

    shown = [
        message(write(tmp_path / "c.yaml", MODEL + "client:\n  lr: 0.1\n  epochs: 2\n\n  lr: 5\n")),
        message(DEFAULT_CONFIG, "strategy.threshold=1e309"),
        message(DEFAULT_CONFIG, ("seed", 2**64)),
        message(DEFAULT_CONFIG, ("rounds", 2**63)),
        message(DEFAULT_CONFIG, ("partition.num_clients", 10**9)),
        message(ROOT / "conf" / "dac_fmnist_rot4.yaml", "partition.angles=[0, .inf, 180, 270]"),
    ]
    big = tmp_path / "big.yaml"
    with open(big, "w") as handle:
        handle.write("x: [" + "1," * 13_000_000 + "1]\n")
    shown.append(message(big))
    for text in shown:
        assert f"`{text}`" in page, text
