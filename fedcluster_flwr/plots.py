"""The plots of a run and of several: accuracy per round with its phase changes, a comparison of
runs, a clustering's dendrogram, client-by-client heat maps.

Nothing here knows the strategies or reads a run folder: what a phase means comes in as data
(``phase_words``), and so do the rows of the runs drawn (:mod:`fedcluster_flwr.results` reads and
writes the folders; the strategies draw their own figures with these functions).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np


if TYPE_CHECKING:
    from .config.sections import ExperimentConfig

RoundRow = Mapping[str, Any]  # one line of a run's rounds.jsonl
RunCurve = tuple[str, Mapping[str, Any], Sequence[RoundRow]]  # a run's name, resolved config and rows


PHASE_MARK = {"color": "black", "lw": 0.9, "alpha": 0.7}  # a colour no cluster line takes (_cluster_colours)
PHASE_STYLES = (":", "-.", (0, (5, 2, 1, 2, 1, 2)), (0, (1, 3)))


def plot_rounds(
    rows: Sequence[RoundRow], out_dir: Path, target_accuracy: float, title: str,
    phase_words: Mapping[str, str] | None = None,
) -> None:
    """``accuracy.png`` (mean and per-cluster) and ``clients_over_target.png``; a dotted line marks
    each round where the run's phase changes (FL+HC's clustering, DAC's end of pretraining), named
    in the legend (in the words :func:`phase_words` gives, ``phase_words`` the caller's), which
    sits outside the axes so that it covers no line."""
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
    _mark_phase_changes(ax, rows, phase_words)
    ax.set(xlabel="round", ylabel="test accuracy", title=title, ylim=(0, 1.01))
    _round_axis(ax, rounds)
    _legend_outside(ax)
    fig.savefig(out_dir / "accuracy.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(rounds, [_nan(r.get("pct_clients_over_target")) for r in rows], color="tab:green", lw=2,
            label="clients over target")
    _mark_phase_changes(ax, rows, phase_words)
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


def plot_comparison(runs: Sequence[RunCurve], out_path: Path) -> None:
    """Mean client accuracy of several runs (each: its name, config and rows, as
    :func:`fedcluster_flwr.results.run_files.run_curves` reads them) on one chart (``fedcluster
    compare`` and ``plot``), with each run's target accuracy, titled by what they ran on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    all_rounds: list[int] = []
    for name, config, rows in runs:
        strategy = config["strategy"].get("name", "?")
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


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _cluster_sort_key(key: str) -> tuple[int, str]:
    return (0, f"{int(key):09d}") if key.lstrip("-").isdigit() else (1, key)


# What a round's phase (rounds.jsonl's "phase") means, for the legend of the accuracy plots: the
# phases several algorithms share. A family's own phases ("pretrain", "lps") and a phase named after
# its algorithm ("dac") are worded by the caller (plot_rounds' phase_words: each strategy class's
# ``phase_words`` and ``round_word``), else "<phase> rounds".
PHASE_WORDS = {
    "fedavg": "FedAvg, one shared model",
    "warmup": "warm-up, one shared model",
    "clustering": "clustering round",
    "clustered": "training per cluster",
}


def phase_words(phase: Any, words: Mapping[str, str] | None = None) -> str:
    """A phase name in words: a shared phase from :data:`PHASE_WORDS` (``"pretrain"`` -> "local
    pretraining"), else the caller's ``words`` for it (``{"dac": "dac gossip exchanges"}``), else
    "<phase> rounds" (``"ifca"`` -> "ifca rounds")."""
    if phase in PHASE_WORDS:
        return PHASE_WORDS[phase]
    if words is not None and phase in words:
        return words[phase]
    return f"{phase} rounds"


def _mark_phase_changes(ax: Any, rows: Sequence[RoundRow], words: Mapping[str, str] | None) -> None:
    """A black line (no cluster line is black) at each round whose phase differs from the round
    before, each change in its own dash pattern and named in the legend by what ends and what
    begins: "round 2: local pretraining → dac gossip exchanges" (:func:`phase_words`)."""
    changes = [(before, after) for before, after in zip(rows, rows[1:]) if before.get("phase") != after.get("phase")]
    for k, (before, after) in enumerate(changes):
        ax.axvline(after["round"], ls=PHASE_STYLES[k % len(PHASE_STYLES)], **PHASE_MARK,
                   label=f"round {after['round']}: {phase_words(before.get('phase'), words)} → "
                         f"{phase_words(after.get('phase'), words)}")


def run_title(config: ExperimentConfig) -> str:
    return f"{config.strategy.name} on {config.dataset.name} / {config.partition.name} ({config.partition.num_clients} clients)"


def strategy_phase_words(classes: Iterable[type]) -> dict[str, str]:
    """How the plots' legend words the phases of the strategy ``classes`` (a run's own: its
    strategy class) where "<phase> rounds" (:func:`phase_words`' default) would not say it: each
    class's own phases (``phase_words``: "pretrain" -> "local pretraining") and a gossip strategy's
    exchange rounds ("dac" -> "dac gossip exchanges", its ``round_word``)."""
    words: dict[str, str] = {}
    for cls in classes:
        words.update(cls.phase_words)
        if cls.round_word != "rounds":
            words[cls.name] = f"{cls.name} {cls.round_word}"
    return words
