"""Run folders received from someone else: resuming or branching one never follows a symbolic link
out of it, never reads a device, FIFO or socket, and stops on a loop, in one error line naming the
entry, with nothing written (the source untouched, no branch folder). Real folders, real links."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import yaml

from fedcluster_flwr.cli import console
from fedcluster_flwr.results.recorder import branch_run
from fedcluster_flwr.results.run_files import DamagedRunError, run_folder_entries
from test_bad_input import a_run


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``folder`` (not following links): its mode, size and modification time."""
    found = {}
    for path in sorted(folder.rglob("*")):
        status = path.lstat()
        found[str(path.relative_to(folder))] = (status.st_mode, status.st_size, status.st_mtime_ns)
    return found


def fedcluster_error(capsys, *argv: str) -> str:
    """The one error line of ``fedcluster`` for ``argv`` (exit code 2, nothing else on stderr)."""
    assert console.main([*argv, "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0], lines
    return lines[0].removeprefix("error: ")


def link(path: Path, target: str | Path) -> Path:
    path.symlink_to(target)
    return path


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def make_socket(path: Path) -> Path:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))  # the socket file stays after the socket is closed
    return path


DAMAGES = {  # what a received run folder holds -> (the entry the error names, what it says)
    "link-to-a-device": (lambda run: link(run / "checkpoint" / "extra.npy", "/dev/zero"),
                         "is a symbolic link out of the run folder (to /dev/zero)"),
    "link-to-an-outside-file": (lambda run: link(run / "notes.txt", run.parent / "elsewhere.txt"),
                                "is a symbolic link out of the run folder (to {tmp}/elsewhere.txt)"),
    "link-to-its-own-folder": (lambda run: link(run / "sub", "."), "a folder that holds it: a loop"),
    "link-to-itself": (lambda run: link(run / "loop", "loop"), "is a symbolic link that loops (loop)"),
    "checkpoint-a-looping-link": (lambda run: (os.rename(run / "checkpoint", run / "kept"),
                                               link(run / "checkpoint", "checkpoint"))[1],
                                  "is a symbolic link that loops (checkpoint)"),
    "link-to-nothing": (lambda run: link(run / "gone.npy", run / "never_written.npy"), "is a symbolic link to nothing"),
    "fifo": (lambda run: make_fifo(run / "checkpoint" / "pipe"), "is a FIFO (a named pipe), not a file a run writes"),
    "socket": (lambda run: make_socket(run / "sock"), "is a socket, not a file a run writes"),
}


@pytest.mark.parametrize("branch", [False, True], ids=["resume", "branch"])
@pytest.mark.parametrize("damage", DAMAGES, ids=str)
def test_a_received_run_folder_with_what_a_run_never_writes_is_one_line_naming_it_and_nothing_is_written(
        tmp_path, capsys, damage, branch):
    (tmp_path / "elsewhere.txt").write_text("a file outside the run folder\n")
    make, says = DAMAGES[damage]
    run = a_run(tmp_path)
    entry = make(run)
    before = snapshot(run)
    out = ["--out", str(tmp_path / "branch"), "--set", "strategy.threshold=25"] if branch else []
    message = fedcluster_error(capsys, "resume", str(run), *out)
    assert message.startswith(f"{entry}: ") and says.format(tmp=tmp_path) in message, message
    assert snapshot(run) == before and not (tmp_path / "branch").exists()


def test_a_device_in_a_run_folder_is_named_as_such(tmp_path):
    run = a_run(tmp_path)
    try:
        os.mknod(run / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("making a device file needs root")
    with pytest.raises(DamagedRunError, match=rf"^{run / 'zero'}: is a device, not a file a run writes"):
        run_folder_entries(run)


def test_links_that_stay_inside_the_folder_are_followed_and_a_branch_copies_their_files(tmp_path):
    """A link to a file or a folder of the run itself is no danger: the branch holds copies."""
    run = a_run(tmp_path)
    link(run / "config_link.yaml", "config.yaml")
    link(run / "checkpoint_link", "checkpoint")
    (run / "accuracy.png").write_bytes(b"\x89PNG")  # plots are not copied
    entries = run_folder_entries(run)
    assert Path("checkpoint_link") in entries and Path("checkpoint_link/state.json") in entries
    config = yaml.safe_load((run / "config.yaml").read_text())
    branch_run(run, tmp_path / "branch", config, 3, ["strategy.threshold=25"])
    copied = tmp_path / "branch"
    assert not (copied / "config_link.yaml").is_symlink() and (copied / "config_link.yaml").is_file()
    assert (copied / "checkpoint_link" / "models.npz").read_bytes() == (run / "checkpoint" / "models.npz").read_bytes()
    assert not (copied / "accuracy.png").exists() and (copied / "branch.json").is_file()


def test_a_last_row_cut_short_by_a_kill_is_not_a_damaged_log(tmp_path):
    """A run killed while appending a round's row leaves half a line; that round is redone on resume,
    so the plan goes ahead (a garbled line before the end is refused: test_bad_input.py's cases)."""
    from fedcluster_flwr.results.run_files import read_rounds
    from fedcluster_flwr.runner import plan_continuation

    run = a_run(tmp_path)
    with open(run / "rounds.jsonl", "a") as log:
        log.write('{"round": 4, "mean_cli')
    assert [row["round"] for row in read_rounds(run)] == [1, 2, 3]
    assert plan_continuation(run).completed_round == 3
