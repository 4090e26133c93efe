"""How runs end. A stopped `fedcluster run` leaves a resumable run and no process behind, with real
processes and real signals (no mocks, slow): Ctrl-C (SIGINT to the process group, as a terminal sends it), SIGTERM (a
scheduler's timeout) and kill -9, each at round 2 of a short default-config run. Then `fedcluster
resume` finishes the run with the rounds and summary of the uninterrupted run, bit for bit (the
reference comes from the in-process driver, which reproduces the Ray engine bit for bit:
test_simulation.py). Processes are read from /proc (psutil is not a dependency).
A resume without a checkpoint, and a `flwr run` whose config is wrong, fail once with the reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEFAULT_CONFIG, ROOT
from helpers import rows_without_timing
from fedcluster_flwr import runner
from fedcluster_flwr.apps.client_app import FedclusterClientApp
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override
from fedcluster_flwr.apps.server_app import RunConfigError, app, run_in_process
from fedcluster_flwr.client import ClusterClient
from fedcluster_flwr.numerics import torch_threads
from fedcluster_flwr.declarations.schema import ConfigError

# Short enough for CI, long enough that FL+HC clusters (round 3) after the stop at round 2.
OVERRIDES = ("rounds=4", "strategy.rounds_before_clustering=2")
STOP_AT_ROUND = 2
STARTUP_TIMEOUT_S = 600  # Ray's start on a loaded 2-core CI machine
EXIT_WITHIN_S = 10


# ---- processes, from /proc ---------------------------------------------------------------------


def process_table() -> dict[int, dict]:
    """Every live process: pid -> ppid, pgid, sid, state, start time (tells a reused pid apart), cmdline."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        table[int(entry)] = {"state": fields[0], "ppid": int(fields[1]), "pgid": int(fields[2]),
                             "sid": int(fields[3]), "start": int(fields[19]), "cmd": cmdline.strip()}
    return table


def tree_of(root: int, table: dict[int, dict]) -> dict[int, dict]:
    """``root`` and its descendants, and every process in the session of any of them (Ray's
    processes, once orphaned, are no one's descendants but keep their session)."""
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in table and pid not in found:
            found[pid] = table[pid]
            frontier += [p for p, info in table.items() if info["ppid"] == pid]
    sessions = {info["sid"] for info in found.values()}
    found.update({p: info for p, info in table.items() if info["sid"] in sessions and p != os.getpid()})
    return found


def alive(processes: dict[int, dict]) -> dict[int, dict]:
    """Those of ``processes`` still running (the same pid and start time, not a zombie)."""
    table = process_table()
    return {p: table[p] for p, info in processes.items()
            if p in table and table[p]["start"] == info["start"] and table[p]["state"] != "Z"}


def describe(processes: dict[int, dict]) -> str:
    return "\n".join(f"  {p} (ppid {i['ppid']}, sid {i['sid']}) {i['cmd'][:100]}" for p, i in sorted(processes.items()))


class Started:
    """The CLI processes a test starts, each in a session of its own; :meth:`kill_all` ends each and
    everything in its tree, also when the test fails."""

    def __init__(self) -> None:
        self.seen: dict[int, dict] = {}
        self.procs: list[subprocess.Popen] = []

    def cli(self, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "fedcluster_flwr.cli", *args], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs.append(proc)
        return proc

    def note(self, proc: subprocess.Popen) -> dict[int, dict]:
        tree = tree_of(proc.pid, process_table())
        self.seen.update(tree)
        return tree

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.note(proc)
        for pid in alive(self.seen):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture
def started():
    procs = Started()
    yield procs
    procs.kill_all()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run's rounds and summary without interruption (in-process: no Ray start to wait for; one
    torch thread, as each Ray client has, makes it bit-identical to the Ray engine's)."""
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in OVERRIDES])
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_in_process(config, out)
    return read_run(out)


def test_the_in_process_driver_trains_on_one_torch_thread_and_restores_the_callers(tmp_path, monkeypatch):
    seen = []
    run = ClusterClient.run
    monkeypatch.setattr(ClusterClient, "run", lambda self, *a: seen.append(torch.get_num_threads()) or run(self, *a))
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=1", "strategy.name=fedavg")])
    with torch_threads(2):
        run_in_process(config, tmp_path / "run")
        assert torch.get_num_threads() == 2
    assert seen and set(seen) == {1}


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("wall_seconds")
    return rows_without_timing(rows), summary


def wait_for_round(proc: subprocess.Popen, run_dir: Path, started: Started, server_round: int) -> dict[int, dict]:
    """Wait (watching rounds.jsonl) until ``server_round`` is logged; return the run's process tree then."""
    rounds = run_dir / "rounds.jsonl"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early ({proc.returncode}): {proc.communicate()[1][-2000:]}"
        if rounds.is_file() and len(rounds.read_text().splitlines()) >= server_round:
            return started.note(proc)
        time.sleep(0.1)
    raise AssertionError(f"round {server_round} not reached in {STARTUP_TIMEOUT_S} s")


def wait_until_gone(processes: dict[int, dict], within_s: float) -> dict[int, dict]:
    deadline = time.monotonic() + within_s
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def stop_at_round_2_and_resume(started: Started, run_dir: Path, stop, settings: tuple[str, ...] = OVERRIDES,
                               ray_process: str = "ray::") -> tuple[int, float, str, str]:
    """Run the default config with ``settings``, ``stop`` it at round 2, check that nothing of it is
    left (a process whose command line holds ``ray_process`` was there before the stop), resume it to
    the end; return the stopped run's exit code, seconds to exit, stdout and stderr."""
    proc = started.cli("run", str(DEFAULT_CONFIG), *(f"--set={o}" for o in settings), "--out", str(run_dir),
                       "--no-progress")
    tree = wait_for_round(proc, run_dir, started, STOP_AT_ROUND)
    assert any(ray_process in info["cmd"] for info in tree.values()), describe(tree)
    sent = time.monotonic()
    stop(proc)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run did not exit after the signal") from None
    seconds = time.monotonic() - sent
    left = wait_until_gone(tree, within_s=EXIT_WITHIN_S)
    assert not left, f"processes left after the stop:\n{describe(left)}"

    resumed = started.cli("resume", str(run_dir), "--no-progress")
    resume_out, resume_err = resumed.communicate(timeout=STARTUP_TIMEOUT_S)
    assert resumed.returncode == 0, resume_err[-3000:]
    assert "mean client accuracy" in resume_out
    return proc.returncode, seconds, out, err


def without_flowers_deprecation_notice(err: str) -> str:
    """``err`` without the notice Flower logs when ``run_simulation`` starts (the Ray engine's one
    deprecated call, shown as Flower words it: docs/how-to/flwr-run.md, "Which Flower API")."""
    notice = re.compile(r"^.*DEPRECATED FEATURE: The `run_simulation` function is deprecated.*?entirely in future "
                        r"versions of Flower\.\n\s*\n?", flags=re.S | re.M)
    return notice.sub("", err, count=1)


def assert_one_line_naming_the_resume(out: str, err: str, run_dir: Path) -> None:
    assert "Traceback" not in out + err and "SIGTERM received" not in out + err and "PC:" not in err, err[-3000:]
    lines = without_flowers_deprecation_notice(err).strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"continue with: fedcluster resume {run_dir}"), err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "send", "code"), [
    ("ctrl-c", lambda proc: os.killpg(proc.pid, signal.SIGINT), 130),  # the terminal signals the whole group
    ("sigterm", lambda proc: proc.send_signal(signal.SIGTERM), 143),
])
def test_a_stopped_run_exits_at_once_leaves_nothing_and_resumes_to_the_same_result(
    name, send, code, started, uninterrupted, tmp_path
):
    run_dir = tmp_path / name
    returncode, seconds, out, err = stop_at_round_2_and_resume(started, run_dir, send)
    assert returncode == code, err[-3000:]
    assert seconds < EXIT_WITHIN_S
    assert_one_line_naming_the_resume(out, err, run_dir)
    assert read_run(run_dir) == uninterrupted


@pytest.mark.slow
def test_kill_9_leaves_no_process_and_the_run_resumes_to_the_same_result(started, uninterrupted, tmp_path):
    run_dir = tmp_path / "kill9"
    returncode, _, _, _ = stop_at_round_2_and_resume(started, run_dir, lambda proc: proc.kill())
    assert returncode == -signal.SIGKILL
    assert read_run(run_dir) == uninterrupted


# ---- without processes -------------------------------------------------------------------------


def test_resuming_a_run_without_a_checkpoint_says_why_and_how_to_start_again(tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override("checkpoint_every=0")])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
    with pytest.raises(ConfigError, match=(
        rf"^RUN_DIR: {run_dir} has no checkpoint/ to resume from: it stopped before its first checkpoint "
        rf"\(it checkpoints only at the end, .*\); start it again with: fedcluster run {run_dir}/config.yaml --out NEW_DIR$"
    )):
        runner.plan_continuation(run_dir)
    assert runner.stop_message("SIGTERM", run_dir).startswith("SIGTERM: stopped before the first checkpoint")


def test_the_default_config_checkpoints_every_round():
    assert load_config(DEFAULT_CONFIG)[0].checkpoint_every == 1


def test_a_client_joining_after_the_last_round_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^simulation.join_round.3: round 31 comes after the last round \(30\)"):
        load_config(DEFAULT_CONFIG, [parse_override("simulation.join_round={3: 31}")])


class Context:
    def __init__(self, run_config, node_config=None):
        self.run_config, self.node_config, self.run_id, self.node_id = run_config, node_config or {}, 1, 1


@pytest.mark.parametrize(("run_config", "message"), [
    ({"rounds": "abc"}, r"^rounds: expected an integer, got 'abc'"),
    ({"set": "strategy.bogus=3"}, r"^strategy.bogus: unknown key"),
])
def test_a_flwr_run_with_a_bad_config_fails_the_run(run_config, message, caplog):
    """Flower marks a run failed only when the ServerApp raises an Exception; a SystemExit ended its
    thread silently and the run counted as completed."""
    with pytest.raises(RunConfigError, match=message):
        app(None, Context(run_config))
    assert sum("fedcluster configuration error" in r.getMessage() for r in caplog.records) == 1


def test_a_supernode_beyond_the_experiment_reports_its_partition_and_the_server_refuses_once(caplog):
    """More SuperNodes than clients: the extra nodes answer who they are (no traceback each), and the
    server names the mismatch once, not once per node; any work such a node is sent fails."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from helpers import synthetic_grid
    from fedcluster_flwr import protocol
    from fedcluster_flwr.algorithms.base import FederationError
    from fedcluster_flwr.algorithms.base.directory import ClientDirectory, Federation
    from fedcluster_flwr.engines.inprocess import InProcessGrid, node_id_of

    config, _ = load_config(DEFAULT_CONFIG)
    grid = InProcessGrid(FedclusterClientApp(Experiment(config)), [{"partition-id": 25, "num-partitions": 26}])
    content = RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND_KEY: 1})})
    (identity,) = grid.send_and_receive([Message(content, node_id_of(0), protocol.IDENTIFY.message_type)])
    assert dict(identity.content[protocol.METRICS]) == {"partition_id": 25, "num_partitions": 26, "own_data": 0}
    evaluation = protocol.EVALUATE.instruction({protocol.MODEL: [Experiment(config).weights()]}, {}, 1)
    (work,) = grid.send_and_receive([Message(evaluation, node_id_of(0), protocol.EVALUATE.message_type)])
    assert work.error.reason.endswith("partition-id 25 is outside 0..19 (partition.num_clients)")
    directory = ClientDirectory(num_clients=20, federation=Federation(wait_for_clients_s=0))
    with pytest.raises(FederationError, match="num-partitions=26, but partition.num_clients is 20"):
        directory.online_clients(1, synthetic_grid(26, reported=26))
    assert sum("num-partitions=26" in r.getMessage() for r in caplog.records) == 1
