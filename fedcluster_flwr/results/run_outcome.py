"""What a run that ended early left behind, in the one line that says so.

A run stopped by a signal (:class:`fedcluster_flwr.runner.Interrupted`) or failed
(:class:`fedcluster_flwr.runner.RunFailed`) names where its rounds are and how to go on, and
only files that exist: stopped in its first instants, a run has not written its ``config.yaml``
yet, and its folder may not exist.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoints import checkpoint_round


def stop_message(why: str, run_dir: Path) -> str:
    """One line: why the run stopped (``SIGINT``), where its results are and how to continue it."""
    done = checkpoint_round(run_dir)
    if done is not None:
        return f"{why}: stopped; rounds 1-{done} are in {run_dir}; continue with: fedcluster resume {run_dir}"
    if (run_dir / "config.yaml").is_file():
        return (f"{why}: stopped before the first checkpoint, nothing to resume in {run_dir}; "
                f"start again with: fedcluster run {run_dir / 'config.yaml'} --out NEW_DIR")
    return f"{why}: stopped before the run wrote anything; start it again with the same command"


def what_was_kept(run_dir: Path) -> str:
    """What a failed run left in ``run_dir``: its checkpointed rounds, files without a checkpoint,
    or nothing (and whether the folder was created)."""
    done = checkpoint_round(run_dir)
    if done is not None:
        return f"rounds 1-{done} are in {run_dir}, checkpointed (fedcluster resume {run_dir} continues them)"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        return f"partial results in {run_dir} (no checkpoint)"
    return f"nothing was written ({run_dir} {'is empty' if run_dir.is_dir() else 'was not created'})"
