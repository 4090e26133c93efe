"""Run directory: resolved config, per-round metrics, summary, plots and checkpoints.

Layout (the results contract)::

    <run>/config.yaml        resolved experiment config
    <run>/rounds.jsonl       one JSON object per round
    <run>/summary.json       final values; rewritten every round ("finished": false until the end)
    <run>/accuracy.png, clients_over_target.png, dendrogram.png (FL+HC)
    <run>/checkpoint/        state.json + models.npz (its arrays) of the latest checkpoint
    <run>/*.npy, *.png       the strategy's artifacts (linkage.npy, relevance.npy, similarity.npy, ...)
    <run>/branch.json        a branch only: the run and round it continues, and the changed options
    <run>/tracking.json      with ``tracking:`` set: the tracker's run id, reopened on resume
    <run>/tensorboard/       with ``tracking: tensorboard``: the event files

Each file is written atomically (temp file + rename), so an interrupted run never
leaves a truncated file behind; the checkpoint's two files carry their round, so a
run stopped between writing them is detected when resuming.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from .files import atomic_write, mkstemp_public
from .schema import ConfigError
from .tracking import TRACKING_FILE, Tracker, branch_record, check_tracking, open_tracker

RoundRow = dict[str, Any]


class DamagedRunError(ConfigError):
    """A file of a run directory is missing, truncated or not what fedcluster writes; the message
    names the file and what is wrong with it (a user-facing error: one line, no traceback)."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(str(path), message)


def json_ready(value: Any) -> Any:
    """Plain JSON types; NaN/inf become null so the files are strict JSON."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_ready(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(value) else float(value)
    return value


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``summary.json`` of ``run_dir``: a JSON object (``"finished": true`` once the run ended)."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedRunError(path, "not found: the run's summary is missing") from None
    except (OSError, ValueError) as err:
        raise DamagedRunError(path, f"cannot be read as JSON ({' '.join(str(err).split())}): truncated or edited") from None
    if not isinstance(summary, dict):
        raise DamagedRunError(path, f"must hold a JSON object, got {type(summary).__name__}")
    return summary


def format_summary(summary: Mapping[str, Any], run_dir: Path) -> str:
    """A finished run's summary as `fedcluster run` (and a `flwr run` at its end) prints it."""
    def pct(value: Any) -> str:
        return "n/a" if value is None else f"{100 * value:.1f} %"

    reached = summary.get("rounds_to_target")
    over = "n/a" if summary.get("pct_clients_over_target") is None else f"{summary['pct_clients_over_target']:.1f} %"
    target = summary.get("target_accuracy")
    def by_cluster(key: str) -> str:
        clusters = summary.get(key) or {}
        text = "  ".join(f"{k}: {pct(v)}" for k, v in list(clusters.items())[:12])
        return text + (f"  ... ({len(clusters)} clusters)" if len(clusters) > 12 else "")

    scores = ", ".join(
        f"{name} {summary[key]:.2f}" for key, name in (("purity", "purity"), ("ari", "ARI"), ("nmi", "NMI"))
        if summary.get(key) is not None
    )
    lines = [
        f"  mean client accuracy   {pct(summary.get('mean_client_accuracy'))} "
        f"(best {pct(summary.get('best_mean_client_accuracy'))})",
        f"  clients over target    {over} (target {target:g}; the mean "
        f"{f'reached it at round {reached}' if reached else 'never reached the target'})",
        f"  clusters               {summary.get('num_clusters')} ({scores})",
        f"  per-cluster accuracy   {by_cluster('per_cluster_accuracy')}",
        f"  per true cluster       {by_cluster('per_true_cluster_accuracy')}",
        f"  communication          up {summary['bytes_up'] / 1e6:.1f} MB, down {summary['bytes_down'] / 1e6:.1f} MB",
        f"  failures               {summary['fit_failures']} failed fits, {summary['rejected_updates']} rejected updates",
        f"  wall time              {summary['wall_seconds']:.1f} s",
        f"  results                {run_dir}",
    ]
    return "\n".join(lines)


def run_dir_name(strategy: str, dataset: str, partition: str) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return f"{stamp}_{strategy}_{dataset}_{partition}"


class RunRecorder:
    """Writes a run's results contract as the rounds go by."""

    def __init__(
        self, run_dir: Path, on_round: Callable[[RoundRow], None] | None = None, config: Mapping[str, Any] | None = None
    ):
        self.run_dir = Path(run_dir)
        self.on_round = on_round
        self.config = config or {}  # the resolved config, as plain data: its ``tracking`` is opened
        self.rows: list[RoundRow] = []
        self.tracker: Tracker | None = None  # `tracking:` (fedcluster_flwr.tracking), opened by start/resume

    def start(self, resolved_config: Mapping[str, Any]) -> None:
        """Begin a run in an empty (or new) directory; never overwrite an earlier run."""
        if self.run_dir.is_dir() and any(self.run_dir.iterdir()):
            raise FileExistsError(f"{self.run_dir} already holds files; results go to a new directory")
        check_tracking(str(resolved_config.get("tracking") or "none"))  # a missing package: nothing written
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.run_dir / "config.yaml", yaml.safe_dump(dict(resolved_config), sort_keys=False))
        atomic_write(self.run_dir / "rounds.jsonl", "")
        self.write_summary({"finished": False, "completed_rounds": 0})
        self.config = resolved_config
        self.tracker = open_tracker(self.run_dir, resolved_config, 0)

    def resume(self, completed_round: int) -> None:
        """Continue a run after ``completed_round``: keep the rows up to it, drop later ones."""
        self.rows = [row for row in read_rounds(self.run_dir) if row["round"] <= completed_round]
        atomic_write(self.run_dir / "rounds.jsonl", "".join(json.dumps(row) + "\n" for row in self.rows))
        self.tracker = open_tracker(self.run_dir, self.config, completed_round)

    def log_round(self, row: RoundRow) -> None:
        row = json_ready(row)
        self.rows.append(row)
        # One unbuffered write, one system call: a run killed mid-round never leaves half a row
        # (a buffered file writes a row longer than its 8 KiB buffer in pieces).
        with open(self.run_dir / "rounds.jsonl", "ab", buffering=0) as handle:
            handle.write((json.dumps(row) + "\n").encode())
        if self.tracker is not None:  # after the file: a tracker never holds up or loses a row
            self.tracker.log_round(row)
        if self.on_round is not None:
            self.on_round(row)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        summary = json_ready(summary)
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.tracker is not None:
            self.tracker.log_summary(summary)

    def save_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """``checkpoint/state.json`` and ``checkpoint/models.npz``: the tree ``checkpoint`` (dicts,
        lists, JSON scalars and arrays; see :func:`load_checkpoint`) with every array moved to
        the ``.npz``. Both files carry ``checkpoint["round"]``, so a torn pair is detected."""
        folder = self.run_dir / "checkpoint"
        folder.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {}
        state = {"format": CHECKPOINT_FORMAT, **_arrays_out(checkpoint, arrays)}
        arrays["round"] = np.asarray(checkpoint["round"])
        logged = [row for row in self.rows if row["round"] == checkpoint["round"]]
        if logged:  # ties the checkpoint to this run's log: one copied in from another run is told apart
            state[ROW_DIGEST] = row_digest(logged[-1])
        fd, models_tmp = mkstemp_public(folder, prefix=".models.", suffix=".npz")
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        fd, state_tmp = mkstemp_public(folder, prefix=".state.", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(state, indent=1) + "\n")
        # Both written before either replaces the last checkpoint: a run killed now (kill -9, a
        # stop signal) leaves a torn pair only if killed between the two renames, microseconds
        # rather than the time it takes to write state.json.
        os.replace(models_tmp, folder / "models.npz")
        os.replace(state_tmp, folder / "state.json")

    def write_artifacts(self, artifacts: Mapping[str, Any]) -> None:
        """Files a strategy describes, by name: arrays as ``.npy``, figures drawn to their path."""
        for name, artifact in artifacts.items():
            path = self.run_dir / name
            if isinstance(artifact, np.ndarray):
                fd, tmp = mkstemp_public(self.run_dir, prefix=f".{name}.", suffix=".npy")
                with os.fdopen(fd, "wb") as handle:
                    np.save(handle, artifact)
                os.replace(tmp, path)
            else:
                artifact(path)

    def plot(self, target_accuracy: float, title: str) -> None:
        plot_rounds(self.rows, self.run_dir, target_accuracy, title)


PHASE_MARK = {"color": "black", "lw": 0.9, "alpha": 0.7}  # a colour no cluster line takes (_cluster_colours)
PHASE_STYLES = (":", "-.", (0, (5, 2, 1, 2, 1, 2)), (0, (1, 3)))


def plot_rounds(rows: Sequence[RoundRow], out_dir: Path, target_accuracy: float, title: str) -> None:
    """``accuracy.png`` (mean and per-cluster) and ``clients_over_target.png``; a dotted line marks
    each round where the run's phase changes (FL+HC's clustering, DAC's end of pretraining), named
    in the legend, which sits outside the axes so that it covers no line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    clusters = sorted({c for r in rows for c in (r.get("per_cluster_accuracy") or {})}, key=_cluster_sort_key)
    if 1 < len(clusters) <= 12:
        colours = _cluster_colours(len(clusters))
        for cluster, colour in zip(clusters, colours):
            points = [
                (r["round"], value)
                for r in rows
                if (value := (r.get("per_cluster_accuracy") or {}).get(cluster)) is not None
            ]
            ax.plot(*zip(*points), lw=0.9, alpha=0.7, color=colour, label=f"cluster {cluster}")
    ax.plot(rounds, [_nan(r.get("mean_client_accuracy")) for r in rows], color="black", lw=2, label="mean client")
    ax.axhline(target_accuracy, color="grey", ls="--", lw=1, label=f"target {target_accuracy:g}")
    _mark_phase_changes(ax, rows)
    ax.set(xlabel="round", ylabel="test accuracy", title=title, ylim=(0, 1.01))
    _round_axis(ax, rounds)
    _legend_outside(ax)
    fig.savefig(out_dir / "accuracy.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(rounds, [_nan(r.get("pct_clients_over_target")) for r in rows], color="tab:green", lw=2,
            label="clients over target")
    _mark_phase_changes(ax, rows)
    ax.set(xlabel="round", ylabel=f"% clients with accuracy >= {target_accuracy:g}", title=title, ylim=(0, 101))
    _round_axis(ax, rounds)
    _legend_outside(ax)
    fig.savefig(out_dir / "clients_over_target.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def _cluster_colours(count: int) -> list[Any]:
    """Colours for ``count`` cluster lines: tab10 (tab20 beyond 9) without its greys, which the
    target line and the phase markers use."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if count <= 9 else "tab20"].colors
    return [c for c in palette if len(set(np.round(c, 3))) > 1][:count]


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """A run's ``config.yaml`` as plain data (for plots and tables: no validation)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise DamagedRunError(path, "not found: is this a fedcluster run directory?")
    try:
        config = yaml.safe_load(path.read_text(errors="replace"))
    except yaml.YAMLError as err:
        raise DamagedRunError(path, f"is not valid YAML ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("strategy"), dict):
        raise DamagedRunError(path, "holds no strategy section: not a fedcluster run's config")
    return config


def plot_comparison(run_dirs: Sequence[Path], out_path: Path) -> None:
    """Mean client accuracy of several runs on one chart (``fedcluster compare`` and ``plot``), with
    each run's target accuracy, titled by what they ran on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_run_config(d), read_rounds(d)) for d in run_dirs]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    all_rounds: list[int] = []
    for run_dir, config, rows in runs:
        strategy, name = config["strategy"].get("name", "?"), run_dir.name
        label = strategy if name == strategy else f"{strategy} ({name})"
        all_rounds += [r["round"] for r in rows]
        ax.plot([r["round"] for r in rows], [_nan(r.get("mean_client_accuracy")) for r in rows], lw=1.8, label=label)
    targets = sorted({c.get("target_accuracy") for _, c, _ in runs} - {None})
    for target, style in zip(targets, ("--", ":", "-.", (0, (5, 5)))):  # runs with different targets: told apart
        ax.axhline(target, color="grey", ls=style, lw=1, label=f"target {target:g}")
    ax.set(xlabel="round", ylabel="mean client test accuracy", ylim=(0, 1.01), title=_comparison_title([c for _, c, _ in runs]))
    _round_axis(ax, all_rounds)
    _legend_outside(ax)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _comparison_title(configs: Sequence[Mapping[str, Any]]) -> str:
    """"Mean client accuracy: digits / label_swap (20 clients)", or without the setting where the runs differ in it."""
    settings = {
        (c.get("dataset", {}).get("name"), c.get("partition", {}).get("name"), c.get("partition", {}).get("num_clients"))
        for c in configs
    }
    if len(settings) != 1 or None in next(iter(settings)):
        return "Mean client accuracy per round"
    dataset, partition, clients = next(iter(settings))
    return f"Mean client accuracy per round: {dataset} / {partition} ({clients} clients)"


def _round_axis(ax: Any, rounds: Sequence[int]) -> None:
    """Rounds are whole numbers: integer ticks only, and a little room at both ends."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if rounds:
        ax.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)
    ax.grid(alpha=0.3)


def _legend_outside(ax: Any) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


DENDROGRAM_LEAF_FONT_PT = 7.0  # the smallest leaf label drawn: readable in the saved figure at 100 %
DENDROGRAM_INCHES_PER_LEAF = 0.14  # a 7 pt label's line height (~0.12 in) plus a gap: rotated labels never touch
DENDROGRAM_LABELLED_LEAVES = 200  # up to this many leaves every leaf is labelled (a figure up to 28 in wide)


def dendrogram_cut_height(linkage: np.ndarray, num_clusters: int) -> float:
    """A height at which cutting ``linkage`` leaves ``num_clusters`` clusters: halfway between the
    last merge made and the first one not made (above the top merge for one cluster, below the
    first for one cluster per leaf)."""
    heights = np.asarray(linkage)[:, 2]
    merges = len(heights)  # n - 1 for n leaves
    made = merges + 1 - num_clusters  # merges done to get from n leaves to num_clusters clusters
    if made <= 0:
        return float(heights[0]) / 2
    if made >= merges:
        return float(heights[-1]) * 1.05 or 1.0
    return float(heights[made - 1] + heights[made]) / 2


def plot_dendrogram(linkage: np.ndarray, labels: list[str], threshold: float | None, path: Any, title: str,
                    num_clusters: int | None = None) -> None:
    """Dendrogram with leaves labelled ``client:true cluster`` and the cut drawn and named in the
    legend: at ``threshold`` where the clustering used one, else at the height that leaves the
    ``num_clusters`` clusters found. Leaf labels are never under 7 pt: the figure widens with the
    leaves (0.14 in each) up to 200 leaves; beyond, every k-th leaf is labelled (k the smallest that
    keeps 200 labels or fewer), which the axis label says."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.cluster.hierarchy import dendrogram

    count = len(labels)
    every = max(1, math.ceil(count / DENDROGRAM_LABELLED_LEAVES))
    width = max(6.0, DENDROGRAM_INCHES_PER_LEAF * count / every + 1.0)
    cut = threshold if threshold is not None or num_clusters is None else dendrogram_cut_height(linkage, num_clusters)
    fig, ax = plt.subplots(figsize=(width, 4.5))
    dendrogram(linkage, labels=labels, color_threshold=cut, ax=ax, leaf_font_size=DENDROGRAM_LEAF_FONT_PT,
               leaf_rotation=90)
    if every > 1:  # only every k-th leaf keeps its label, so that the labels stay readable
        ticks = ax.get_xticklabels()
        for position, tick in enumerate(ticks):
            if position % every:
                tick.set_text("")
        ax.set_xticks(ax.get_xticks(), [t.get_text() for t in ticks], rotation=90, fontsize=DENDROGRAM_LEAF_FONT_PT)
    if cut is not None:
        name = (f"cut: threshold {threshold:g}" if threshold is not None
                else f"cut: {num_clusters} clusters (height {cut:.3g})")
        ax.axhline(cut, color="tab:red", ls="--", lw=1, label=name)
        ax.legend(fontsize=8, loc="upper right")
    leaves = "client:true cluster" + (f" (1 leaf in {every} labelled, of {count})" if every > 1 else "")
    ax.set(title=title, ylabel="distance", xlabel=leaves)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CLIENT_MATRIX_INCHES = (7.2, 6.0)  # fixed: a matrix of 1,000 clients makes no larger a file than one of 10
PER_CLIENT_TICKS_UP_TO = 30  # clients; beyond, only the cluster blocks are labelled (7 pt ids need ~0.12 in each)
CLIENT_ID_FONT_PT = 7.0
BLOCK_LABEL_FONT_PT = 8.0
LABEL_LINE_HEIGHT = 1.4  # a label's footprint along its axis, in units of its font size (text plus a gap)


def spread_labels(centres: Sequence[float], gap: float, low: float, high: float) -> np.ndarray:
    """Positions for labels meant to sit at ``centres`` (ascending), moved as little as a left-to-right
    then right-to-left pass moves them so that neighbours are at least ``gap`` apart and all lie in
    [``low``, ``high``]; the caller makes sure that ``len(centres) * gap`` fits."""
    positions = np.asarray(centres, dtype=float).copy()
    for k in range(len(positions)):
        floor = low + gap / 2 if k == 0 else positions[k - 1] + gap
        positions[k] = max(positions[k], floor)
    for k in reversed(range(len(positions))):
        ceiling = high - gap / 2 if k == len(positions) - 1 else positions[k + 1] - gap
        positions[k] = min(positions[k], ceiling)
    return positions


def _label_blocks(ax: Any, axis: str, centres: np.ndarray, labels: Sequence[str], count: int, axis_inches: float) -> None:
    """Each block's label beside the matrix, joined to its block's centre by a short line (a tick
    where the label fits, a leader where it had to move away from a neighbour's)."""
    from matplotlib.transforms import blended_transform_factory

    gap = BLOCK_LABEL_FONT_PT * LABEL_LINE_HEIGHT / 72 * count / axis_inches  # in matrix cells
    positions = spread_labels(centres, gap, -0.5, count - 0.5)
    line = {"arrowstyle": "-", "lw": 0.6, "color": "0.3", "shrinkA": 1, "shrinkB": 0}
    if axis == "y":
        where = blended_transform_factory(ax.transAxes, ax.transData)
        for centre, position, label in zip(centres, positions, labels):
            ax.annotate(label, xy=(0.0, centre), xycoords=where, xytext=(-0.03, position), textcoords=where,
                        ha="right", va="center", fontsize=BLOCK_LABEL_FONT_PT, arrowprops=line, annotation_clip=False)
    else:
        where = blended_transform_factory(ax.transData, ax.transAxes)
        for centre, position, label in zip(centres, positions, labels):
            ax.annotate(label, xy=(centre, 0.0), xycoords=where, xytext=(position, -0.03), textcoords=where,
                        ha="center", va="top", rotation=90, fontsize=BLOCK_LABEL_FONT_PT, arrowprops=line,
                        annotation_clip=False)


def plot_client_matrix(
    matrix: np.ndarray,
    groups: np.ndarray,
    group_names: Sequence[str] | None,
    path: Path,
    title: str,
    colour_label: str,
    clients: Sequence[int] | None = None,
    found: np.ndarray | None = None,
    colour_range: tuple[float, float] | None = (0.0, 1.0),
) -> list[str]:
    """Heat map of a client-by-client ``matrix`` at a fixed size, readable at 10 and at 1,000
    clients: rows and columns ordered by ``groups`` (the true clusters), each group's block outlined
    and labelled with its name and size ("180° (20)") on both axes; client ids along the top where
    there are at most 30. Every block gets its label: labels of blocks too thin to hold one are moved
    apart and joined to their block by a line; only where more blocks than fit at 8 pt, 1 block in k
    is labelled (k the smallest that fits), which a note under the figure says. ``colour_range``: the colours'
    scale, default 0-1 (shares); None: the data's range off the diagonal (a client's value with
    itself says nothing), said in the colour bar's label. ``clients`` names the rows (default
    0..N-1); ``found`` (a clustering's labels, optional) is drawn as a strip beside the rows, so a
    clustering that cuts across the true blocks shows. Returns the block labels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = np.asarray(groups)
    count = len(groups)
    clients = np.arange(count) if clients is None else np.asarray(clients)
    order = np.lexsort((clients, groups))
    ordered = groups[order]
    values, starts, sizes = np.unique(ordered, return_index=True, return_counts=True)
    matrix = np.asarray(matrix, dtype=float)
    if colour_range is None:
        off_diagonal = matrix[~np.eye(count, dtype=bool)]
        off_diagonal = off_diagonal[np.isfinite(off_diagonal)]
        low, high = (float(off_diagonal.min()), float(off_diagonal.max())) if off_diagonal.size else (0.0, 1.0)
        high = high if high > low else low + 1.0  # a constant matrix: any colour, but a valid scale
        colour_label = f"{colour_label}\n(colours span the data: {low:.3g} to {high:.3g}, diagonal left out)"
    else:
        low, high = colour_range
    fig = plt.figure(figsize=CLIENT_MATRIX_INCHES)
    grid = fig.add_gridspec(1, 3, width_ratios=(1.0, 0.035 if found is not None else 0.001, 0.04), wspace=0.05)
    ax = fig.add_subplot(grid[0, 0])
    fig.subplots_adjust(left=0.2, right=0.88, bottom=0.17, top=0.9)
    image = ax.imshow(matrix[np.ix_(order, order)], cmap="viridis", vmin=low, vmax=high,
                      interpolation="antialiased", aspect="auto")
    for start in starts[1:]:  # block boundaries
        ax.axhline(start - 0.5, color="white", lw=0.8)
        ax.axvline(start - 0.5, color="white", lw=0.8)
    names = [group_names[int(v)] if group_names is not None and 0 <= int(v) < len(group_names) else f"cluster {v}"
             for v in values]
    centres = starts + (sizes - 1) / 2
    box = ax.get_position()
    height_in, width_in = box.height * CLIENT_MATRIX_INCHES[1], box.width * CLIENT_MATRIX_INCHES[0]
    room = int(min(height_in, width_in) / (BLOCK_LABEL_FONT_PT * LABEL_LINE_HEIGHT / 72))  # labels that fit
    every = max(1, math.ceil(len(values) / room))
    shown = np.arange(len(values)) % every == 0
    labels = [f"{name} ({size})" for name, size, ok in zip(names, sizes, shown) if ok]
    _label_blocks(ax, "y", centres[shown], labels, count, height_in)
    _label_blocks(ax, "x", centres[shown], labels, count, width_in)
    ax.set_yticks([])
    ax.set_xticks([])
    rules = ["rows and columns: clients by true cluster"]
    if count > PER_CLIENT_TICKS_UP_TO:
        rules.append(f"client ids shown up to {PER_CLIENT_TICKS_UP_TO} clients")
    if every > 1:
        rules.append(f"1 block in {every} labelled, of {len(values)}")
    fig.text((box.x0 + box.x1) / 2, 0.01, "; ".join(rules), ha="center", va="bottom", fontsize=7)
    if count <= PER_CLIENT_TICKS_UP_TO:  # few clients: their ids along the top (rows are in the same order)
        ax.set_xticks(range(count), [str(c) for c in clients[order]], minor=True, fontsize=CLIENT_ID_FONT_PT, rotation=90)
        ax.tick_params(axis="x", which="minor", length=2, top=True, bottom=False, labeltop=True, labelbottom=False)
    ax.set_title(title, fontsize=9, pad=24 if count <= PER_CLIENT_TICKS_UP_TO else 6)
    if found is not None:
        strip = fig.add_subplot(grid[0, 1])
        strip.imshow(np.asarray(found)[order][:, None], cmap="tab20", aspect="auto", interpolation="nearest")
        strip.set_xticks([0], ["found"], fontsize=7, rotation=90)
        strip.set_yticks([])
    fig.colorbar(image, cax=fig.add_subplot(grid[0, 2]), label=colour_label)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return labels


BRANCH_FILE = "branch.json"


def branch_run(
    source: Path, target: Path, resolved_config: Mapping[str, Any], completed_round: int, overrides: Sequence[str]
) -> None:
    """Start run ``target`` as a copy of run ``source`` at its checkpoint (``completed_round``),
    with ``resolved_config`` (the source's, with ``overrides`` applied).

    ``branch.json`` records where the branch came from; ``rounds.jsonl`` is cut back to the
    checkpoint when the branch resumes. Plots and a saved update matrix are not copied.
    """
    if target.is_dir() and any(target.iterdir()):
        raise FileExistsError(f"{target} already holds files; give a new directory (results are never overwritten)")
    shutil.copytree(  # the source's tracker run is its own: the branch gets a link to it instead
        source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.png", "updates.npy", ".*", TRACKING_FILE)
    )
    if (link := branch_record(source, completed_round)) is not None:
        atomic_write(target / TRACKING_FILE, json.dumps(link, indent=2) + "\n")
    atomic_write(target / "config.yaml", yaml.safe_dump(dict(resolved_config), sort_keys=False))
    atomic_write(target / "summary.json", json.dumps({"finished": False, "completed_rounds": completed_round}) + "\n")
    earlier = source / BRANCH_FILE
    provenance = {
        "source": str(source),
        "round": completed_round,
        "overrides": list(overrides),
        "source_branch": json.loads(earlier.read_text()) if earlier.is_file() else None,
    }
    atomic_write(target / BRANCH_FILE, json.dumps(provenance, indent=2) + "\n")


ROW_DIGEST = "row_digest"  # state.json: row_digest() of the checkpoint round's row in rounds.jsonl


def row_digest(row: Mapping[str, Any]) -> str:
    """A fingerprint of a round's row as ``rounds.jsonl`` holds it. Rows carry the round's wall
    seconds, so two runs (even of one config) practically never share one."""
    return hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()[:16]


CHECKPOINT_FORMAT = 2  # 1: before strategies had state_dict() (models by name + flat state); not readable
_ARRAY, _INT_KEYS = "__array__", "__int_keys__"


def _arrays_out(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` as JSON, each array replaced by a reference into ``arrays``; a dict with int
    keys (cluster ids, partition ids) is marked so that they come back as ints."""
    if isinstance(value, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {_ARRAY: key}
    if isinstance(value, Mapping):
        int_keys = bool(value) and all(isinstance(k, (int, np.integer)) for k in value)
        plain = {str(k): _arrays_out(v, arrays) for k, v in value.items()}
        return {_INT_KEYS: plain} if int_keys else plain
    if isinstance(value, (list, tuple)):
        return [_arrays_out(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _arrays_in(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if _ARRAY in value:
            return arrays[value[_ARRAY]]
        if _INT_KEYS in value:
            return {int(k): _arrays_in(v, arrays) for k, v in value[_INT_KEYS].items()}
        return {k: _arrays_in(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_arrays_in(v, arrays) for v in value]
    return value


def read_checkpoint_state(run_dir: Path) -> dict[str, Any]:
    """``checkpoint/state.json`` of ``run_dir``, checked: a JSON object of this checkpoint format
    with an integer ``round`` and the ``strategy`` and ``log`` states (arrays still references)."""
    path = Path(run_dir) / "checkpoint" / "state.json"
    if not path.is_file():
        raise DamagedRunError(path, "not found: the run has no checkpoint to resume from")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise DamagedRunError(path, "is empty (the run was stopped while writing it, or the file was truncated)")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as err:
        raise DamagedRunError(path, f"is not valid JSON ({err.msg}: line {err.lineno}, column {err.colno}): truncated or edited") from None
    if not isinstance(state, dict):
        raise DamagedRunError(path, f"must hold a JSON object, got {type(state).__name__}")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise DamagedRunError(
            path, f"has checkpoint format {state.get('format', 1)}; this version reads format {CHECKPOINT_FORMAT} "
            "only (resume it with the fedcluster version that wrote it)"
        )
    done = state.get("round")
    if isinstance(done, bool) or not isinstance(done, int) or done < 1:
        got = "none" if done is None else repr(done)
        raise DamagedRunError(path, f"lacks its round number (\"round\": a positive integer; got {got}): not a complete checkpoint")
    missing = [key for key in ("strategy", "log") if not isinstance(state.get(key), dict)]
    if missing:
        raise DamagedRunError(path, f"lacks the {' and '.join(missing)} state: not a complete checkpoint")
    return state


def _array_references(value: Any) -> list[str]:
    if isinstance(value, dict):
        if _ARRAY in value:
            return [value[_ARRAY]]
        return [key for v in value.values() for key in _array_references(v)]
    if isinstance(value, list):
        return [key for v in value for key in _array_references(v)]
    return []


def check_checkpoint_arrays(run_dir: Path, state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Check ``checkpoint/models.npz`` against its ``state.json`` without reading the arrays: a
    readable zip of the same round holding every array the state refers to. Returns each
    array's shape (from the ``.npy`` headers)."""
    import zipfile

    path = Path(run_dir) / "checkpoint" / "models.npz"
    if not path.is_file():
        raise DamagedRunError(path, "not found: the checkpoint's arrays are missing")
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, _ = read_header(member)
                shapes[info.filename.removesuffix(".npy")] = shape
            with archive.open("round.npy") as member:
                saved_round = int(np.lib.format.read_array(member))
    except KeyError:
        raise DamagedRunError(path, "holds no round: not a fedcluster checkpoint") from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise DamagedRunError(path, f"is truncated or corrupted ({' '.join(str(err).split()) or type(err).__name__})") from None
    if saved_round != state["round"]:
        raise DamagedRunError(
            path, f"is torn: models of round {saved_round}, {path.parent / 'state.json'} of round {state['round']} "
            "(the run stopped while writing them)"
        )
    missing = [key for key in _array_references(state) if key not in shapes]
    if missing:
        raise DamagedRunError(path, f"lacks {len(missing)} of the arrays state.json refers to (e.g. {missing[0]}): truncated or replaced")
    return shapes


def checkpoint_array_shape(run_dir: Path, state: Mapping[str, Any], name: str) -> tuple[int, ...] | None:
    """The shape of the strategy state's array ``name`` (e.g. ``assignment``, one entry per client)
    in the checkpoint, from its header; None where the state holds no such array."""
    reference = state["strategy"].get(name)
    if not isinstance(reference, dict) or _ARRAY not in reference:
        return None
    return check_checkpoint_arrays(run_dir, state).get(reference[_ARRAY])


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The checkpoint saved by :meth:`RunRecorder.save_checkpoint`: ``{"round", "strategy", "log"}``
    with its arrays back in place. A missing, truncated or mismatched file is a
    :class:`DamagedRunError` naming it."""
    folder = Path(run_dir) / "checkpoint"
    state = read_checkpoint_state(run_dir)
    check_checkpoint_arrays(run_dir, state)
    try:
        with np.load(folder / "models.npz") as saved:
            arrays = {key: saved[key] for key in saved.files}
    except (ValueError, OSError, EOFError) as err:  # a CRC or length error inside an entry
        raise DamagedRunError(folder / "models.npz", f"is corrupted ({' '.join(str(err).split())})") from None
    checkpoint = _arrays_in(state, arrays)
    del checkpoint["format"]
    checkpoint.pop(ROW_DIGEST, None)  # which run the file belongs to (check_resumable), not the run's state
    return checkpoint


def read_rounds(run_dir: Path) -> list[RoundRow]:
    """The rows of ``rounds.jsonl``. A last line cut short (the run was killed while appending it)
    is left out; any other line that is not a JSON object with a round number is an error."""
    path = Path(run_dir) / "rounds.jsonl"
    if not path.is_file():
        raise DamagedRunError(path, "not found: the run's per-round log is missing")
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break  # the row being appended when the run was killed; its round is redone on resume
            raise DamagedRunError(path, f"line {number} is not valid JSON: truncated or edited") from None
        if not isinstance(row, dict) or isinstance(row.get("round"), bool) or not isinstance(row.get("round"), int):
            raise DamagedRunError(path, f"line {number} is not a round's row (a JSON object with an integer \"round\")")
        rows.append(row)
    return rows


def check_resumable(run_dir: Path) -> dict[str, Any]:
    """Check a run directory before a resume or branch reads it (so that nothing fails once Ray
    has started): its checkpoint's two files, and a ``rounds.jsonl`` holding every round up to the
    checkpoint. Returns ``state.json`` (arrays as references); raises :class:`DamagedRunError`."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        holder = run_dir.parent
        hint = (f"resume the run that holds it: fedcluster resume {holder}" if (holder / "config.yaml").is_file()
                else "give the run's folder (the one holding config.yaml and checkpoint/)")
        raise DamagedRunError(run_dir, f"is a file, not a run directory: {hint}")
    if not run_dir.is_dir():
        raise DamagedRunError(run_dir, "no such run directory")
    if not (run_dir / "config.yaml").is_file():
        raise DamagedRunError(run_dir / "config.yaml", "not found: is this a fedcluster run directory?")
    state = read_checkpoint_state(run_dir)
    check_checkpoint_arrays(run_dir, state)
    rows = read_rounds(run_dir)
    logged = {row["round"] for row in rows}
    missing = [r for r in range(1, state["round"] + 1) if r not in logged]
    if missing:
        raise DamagedRunError(
            run_dir / "rounds.jsonl",
            f"lacks the rows of round{'s' if len(missing) > 1 else ''} {_ranges(missing)}; the checkpoint is at round {state['round']}",
        )
    check_checkpoint_belongs(run_dir, state, rows)
    return state


def check_checkpoint_belongs(run_dir: Path, state: Mapping[str, Any], rows: Sequence[RoundRow]) -> None:
    """The checkpoint must be this run's: its round's row in ``rounds.jsonl`` is the one it was
    saved with. Checked before the config is compared with the checkpoint, so that a checkpoint
    copied in from another run is named as the cause rather than this run's ``config.yaml``.
    Checkpoints written before the digest existed are not checked."""
    digest = state.get(ROW_DIGEST)
    if digest is None:
        return
    done = state["round"]
    row = [r for r in rows if r["round"] == done][-1]
    if row_digest(row) != digest:
        raise DamagedRunError(
            run_dir / "checkpoint",
            f"belongs to another run: its round {done} is not the round {done} that {run_dir / 'rounds.jsonl'} records "
            "(copied in from another run?); put this run's checkpoint/ back, or resume the run it came from",
        )


def _ranges(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _cluster_sort_key(key: str) -> tuple[int, str]:
    return (0, f"{int(key):09d}") if key.lstrip("-").isdigit() else (1, key)


# What a round's phase (rounds.jsonl's "phase") means, for the legend of the accuracy plots. A phase
# named after its strategy (e.g. "dac", "ifca") is that algorithm's own rounds (phase_words).
PHASE_WORDS = {
    "pretrain": "local pretraining",
    "fedavg": "FedAvg, one shared model",
    "warmup": "warm-up, one shared model",
    "clustering": "clustering round",
    "clustered": "training per cluster",
    "gram_eigen": "clients send data summaries",
    "relevance": "clients send relevance rows",
    "lps": "training per cluster",
    "pens_selection": "PENS neighbour selection",
    "pens_gossip": "gossip with the kept neighbours",
}


def phase_words(phase: Any) -> str:
    """A phase name in words: ``"pretrain"`` -> "local pretraining", a gossip strategy's name ->
    "dac gossip exchanges", another strategy's -> "ifca rounds"; unknown names as they are."""
    if phase in PHASE_WORDS:
        return PHASE_WORDS[phase]
    from .registry import strategies

    strategy = strategies().get(phase)
    return str(phase) if strategy is None else f"{phase} {strategy.round_word}"


def _mark_phase_changes(ax: Any, rows: Sequence[RoundRow]) -> None:
    """A black line (no cluster line is black) at each round whose phase differs from the round
    before, each change in its own dash pattern and named in the legend by what ends and what
    begins: "round 2: local pretraining → dac gossip exchanges"."""
    changes = [(before, after) for before, after in zip(rows, rows[1:]) if before.get("phase") != after.get("phase")]
    for k, (before, after) in enumerate(changes):
        ax.axvline(after["round"], ls=PHASE_STYLES[k % len(PHASE_STYLES)], **PHASE_MARK,
                   label=f"round {after['round']}: {phase_words(before.get('phase'))} → {phase_words(after.get('phase'))}")
