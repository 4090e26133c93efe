"""What the plots and the printed summary show, read from the drawn matplotlib objects (texts, tick
labels, colour limits, lines), not from pixels: a round's phase changes explained in the legend, in
a colour no cluster line has and inside the figure; integer round ticks; the comparison's title and
target line; client-matrix heat maps that label every block (or state their rule) and scale their
colours to the data where asked; dendrograms with their cut and readable leaves; the leaderboard's
labelled colour bar; the summary's words when the target was never reached."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import yaml
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.text import Text
from scipy.cluster.hierarchy import fcluster

from helpers import load_benchmark
from fedcluster_flwr.cli import console
from fedcluster_flwr.clustering import ClusteringRecord, hierarchical_clustering
from fedcluster_flwr.plots import (
    phase_words, plot_client_matrix, plot_comparison, plot_dendrogram, plot_rounds, strategy_phase_words,
)
from fedcluster_flwr.results.run_files import format_summary, run_curves

matplotlib.use("Agg")


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, by file name, inspected after they are drawn."""
    figures: dict[str, Figure] = {}
    save = Figure.savefig

    def keep(fig, path, **kwargs):
        save(fig, path, **kwargs)
        fig.canvas.draw()
        figures[Path(path).name] = fig

    import matplotlib.pyplot as plt

    close = plt.close
    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig=None: None)
    yield figures
    for fig in figures.values():
        close(fig)


def flhc_rows(clusters: int = 4, rounds: int = 12, clustering_round: int = 11) -> list[dict]:
    """FL+HC's phases; the clustering late in the run, where a label once ran off the right edge."""
    rows = []
    for r in range(1, rounds + 1):
        phase = "fedavg" if r < clustering_round else ("clustering" if r == clustering_round else "clustered")
        per = {"0": 0.5} if r <= clustering_round else {str(k): 0.6 + 0.05 * k for k in range(clusters)}
        rows.append({"round": r, "phase": phase, "mean_client_accuracy": 0.5 + 0.02 * r,
                     "pct_clients_over_target": 10.0, "per_cluster_accuracy": per})
    return rows


@pytest.mark.parametrize("clusters", [4, 12])
def test_phase_changes_are_in_the_legend_in_a_colour_of_their_own_and_inside_the_figure(drawn, tmp_path, clusters):
    plot_rounds(flhc_rows(clusters), tmp_path, 0.9, "flhc on digits")
    fig = drawn["accuracy.png"]
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "round 11: FedAvg, one shared model → clustering round" in labels
    assert "round 12: clustering round → training per cluster" in labels
    cluster_colours = {to_rgba(line.get_color())[:3] for line in ax.get_lines() if line.get_label().startswith("cluster")}
    assert len(cluster_colours) == clusters  # every cluster its own colour
    markers = [line for line in ax.get_lines() if line.get_label().startswith("round ")]
    assert len(markers) == 2 and all(to_rgba(m.get_color())[:3] not in cluster_colours for m in markers)
    assert all(len(set(c)) > 1 for c in cluster_colours)  # no grey: the target line is grey
    assert not [t for t in ax.texts]  # no free-floating labels that could run off the edge
    legend = ax.get_legend().get_window_extent()
    renderer = fig.canvas.get_renderer()
    tight = fig.get_tightbbox(renderer)  # what bbox_inches="tight" saves, in inches
    assert legend.x1 / fig.dpi <= tight.x1 + 1e-6
    assert "round 11: FedAvg, one shared model → clustering round" in [
        t.get_text() for t in drawn["clients_over_target.png"].axes[0].get_legend().get_texts()]


def test_round_ticks_are_whole_numbers(drawn, tmp_path):
    plot_rounds(flhc_rows(rounds=7, clustering_round=3), tmp_path, 0.9, "t")
    ticks = [t for t in drawn["accuracy.png"].axes[0].get_xticks() if 0.5 <= t <= 7.5]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_the_comparison_has_a_title_a_target_line_and_whole_round_ticks(drawn, tmp_path):
    runs = []
    for name, accuracy in (("fedavg", 0.7), ("flhc", 0.92)):
        run = tmp_path / name
        run.mkdir()
        config = {"strategy": {"name": name}, "target_accuracy": 0.9, "dataset": {"name": "digits"},
                  "partition": {"name": "label_swap", "num_clients": 20}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "rounds.jsonl").write_text("".join(json.dumps({"round": r, "mean_client_accuracy": accuracy}) + "\n"
                                                  for r in range(1, 4)))
        runs.append(run)
    plot_comparison(run_curves(runs), tmp_path / "comparison.png")
    ax = drawn["comparison.png"].axes[0]
    assert ax.get_title() == "Mean client accuracy per round: digits / label_swap (20 clients)"
    target = [line for line in ax.get_lines() if line.get_label() == "target 0.9"]
    assert len(target) == 1 and set(target[0].get_ydata()) == {0.9}
    ticks = [t for t in ax.get_xticks() if 0.5 <= t <= 3.5]
    assert ticks == [1.0, 2.0, 3.0]


SUMMARY = {"mean_client_accuracy": 0.5, "best_mean_client_accuracy": 0.6, "pct_clients_over_target": 0.0,
           "target_accuracy": 0.9, "num_clusters": 1, "purity": 1.0, "bytes_up": 1e6, "bytes_down": 1e6,
           "fit_failures": 0, "rejected_updates": 0, "wall_seconds": 1.0}


def test_the_summary_says_in_words_when_the_target_was_never_reached(tmp_path):
    text = format_summary({**SUMMARY, "rounds_to_target": None}, tmp_path)
    assert "(target 0.9; the mean never reached the target)" in text and "reached it never" not in text
    assert "(target 0.9; the mean reached it at round 7)" in format_summary({**SUMMARY, "rounds_to_target": 7}, tmp_path)


def test_compare_help_lists_the_strategies(capsys):
    from fedcluster_flwr.registry import strategies

    with pytest.raises(SystemExit):
        console.main(["compare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in strategies())


# ---- phase legend ------------------------------------------------------------------------------------


def test_the_gossip_legend_says_that_pretraining_ends_and_the_gossip_begins(drawn, tmp_path):
    """DAC's round 2 was "round 2: dac": a strategy's name, not what changed."""
    rows = [{"round": r, "phase": "pretrain" if r == 1 else "dac", "mean_client_accuracy": 0.3 + 0.05 * r,
             "pct_clients_over_target": 0.0} for r in range(1, 5)]
    from fedcluster_flwr.algorithms.dac.strategy import DAC

    plot_rounds(rows, tmp_path, 0.9, "dac on fmnist", phase_words=strategy_phase_words([DAC]))
    labels = [t.get_text() for t in drawn["accuracy.png"].axes[0].get_legend().get_texts()]
    assert "round 2: local pretraining → dac gossip exchanges" in labels
    assert phase_words("ifca") == "ifca rounds" and phase_words("no_such_phase") == "no_such_phase rounds"
    assert phase_words("fedavg", {"fedavg": "other"}) == "FedAvg, one shared model"  # the shared phases' words stay


def test_a_run_words_the_gossip_strategies_phases_as_gossip_exchanges():
    """The words a run's recorder gets from its strategy class (Experiment.strategy), here of every
    registered class at once: every gossip strategy's exchange rounds, and only theirs, and each
    family's own phases as the family words them; the plots know no strategy."""
    from fedcluster_flwr.algorithms.dac.strategy import Gossip
    from fedcluster_flwr.registry import strategies

    words = strategy_phase_words(strategies().values())
    assert words["dac"] == "dac gossip exchanges" and words["random_gossip"] == "random_gossip gossip exchanges"
    named_after_a_strategy = {phase for phase in words if phase in strategies()}
    assert named_after_a_strategy == {name for name, cls in strategies().items() if issubclass(cls, Gossip)}
    assert words["pretrain"] == "local pretraining" and words["lps"] == "training per cluster"
    assert words["pens_selection"] == "PENS neighbour selection"
    assert phase_words("ifca", words) == "ifca rounds"


# ---- client-matrix heat maps ---------------------------------------------------------------------------


def block_annotations(fig: Figure) -> tuple[list, list]:
    """The block labels beside the matrix: (row labels, column labels), as drawn."""
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text()]
    return [t for t in texts if t.get_rotation() == 0], [t for t in texts if t.get_rotation() == 90]


def overlapping(texts, renderer) -> list[tuple[str, str]]:
    """Pairs of ``texts`` whose letters overlap (an annotation's own extent includes its line: left out)."""
    boxes = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in texts]
    return [(a, b) for k, (a, box_a) in enumerate(boxes) for b, box_b in boxes[k + 1:] if box_a.overlaps(box_b)]


def test_every_block_of_the_heat_map_gets_a_label_readable_and_apart_from_the_others(drawn, tmp_path):
    """1,000 clients, two blocks of 3 and 2 among them: each block, however thin, is labelled on both
    axes at 8 pt, no two labels overlap, and each label's line ends at its block's centre."""
    sizes = [700, 200, 95, 3, 2]
    true = np.random.default_rng(0).permutation(np.repeat(np.arange(5), sizes))
    labels = plot_client_matrix(np.random.default_rng(1).random((1000, 1000)), true, None, tmp_path / "m.png", "t", "share")
    fig = drawn["m.png"]
    rows, columns = block_annotations(fig)
    expected = [f"cluster {k} ({n})" for k, n in enumerate(sizes)]
    assert labels == expected
    assert [t.get_text() for t in rows] == expected and [t.get_text() for t in columns] == expected
    assert all(t.get_fontsize() >= 7 for t in rows + columns)
    renderer = fig.canvas.get_renderer()
    assert not overlapping(rows, renderer) and not overlapping(columns, renderer)
    centres = np.cumsum([0, *sizes[:-1]]) + (np.array(sizes) - 1) / 2
    assert [t.xy[1] for t in rows] == pytest.approx(centres) and [t.xy[0] for t in columns] == pytest.approx(centres)
    assert "client ids shown up to 30 clients" in " ".join(t.get_text() for t in fig.texts)


def test_a_heat_map_with_more_blocks_than_fit_labels_every_kth_and_says_so(drawn, tmp_path):
    true = np.repeat(np.arange(80), 5)  # 80 blocks: more 8 pt labels than the axis holds
    labels = plot_client_matrix(np.random.default_rng(2).random((400, 400)), true, None, tmp_path / "m.png", "t", "share")
    fig = drawn["m.png"]
    rows, columns = block_annotations(fig)
    every = 80 // len(labels) + (80 % len(labels) > 0)
    assert 1 < every < 80 and labels == [f"cluster {k} (5)" for k in range(0, 80, every)]
    assert f"1 block in {every} labelled, of 80" in " ".join(t.get_text() for t in fig.texts)
    renderer = fig.canvas.get_renderer()
    assert not overlapping(rows, renderer) and not overlapping(columns, renderer)


def test_a_few_clients_each_get_their_id(drawn, tmp_path):
    true = np.array([0, 1, 0, 1, 2, 2, 0, 1, 2, 0, 1, 2])
    plot_client_matrix(np.eye(12), true, None, tmp_path / "m.png", "t", "share", clients=list(range(100, 112)))
    ids = [t for t in drawn["m.png"].axes[0].get_xticklabels(minor=True) if t.get_text()]
    assert sorted(int(t.get_text()) for t in ids) == list(range(100, 112))
    assert all(t.get_fontsize() >= 7 for t in ids)


def test_a_heat_map_scaled_to_its_data_says_so_in_the_colour_bar(drawn, tmp_path):
    matrix = np.array([[0.0, 3.0, 40.0], [3.0, 0.0, 12.5], [40.0, 12.5, 0.0]])  # degrees; the diagonal says nothing
    plot_client_matrix(matrix, np.array([0, 0, 1]), None, tmp_path / "m.png", "t", "angle, degrees", colour_range=None)
    fig = drawn["m.png"]
    assert fig.axes[0].images[0].get_clim() == (3.0, 40.0)
    assert fig.axes[-1].get_ylabel() == "angle, degrees\n(colours span the data: 3 to 40, diagonal left out)"
    plot_client_matrix(matrix / 40, np.array([0, 0, 1]), None, tmp_path / "shares.png", "t", "share")
    assert drawn["shares.png"].axes[0].images[0].get_clim() == (0.0, 1.0)  # the default: shares on 0-1


def test_pacfls_proximity_map_is_coloured_over_its_angles(drawn, tmp_path):
    """It was A / 90p on a fixed 0-1 scale: angles of a few degrees to ~90 of 180 all came out dark."""
    from test_pacfl import pacfl_strategy, synthetic_client

    from helpers import synthetic_grid, synthetic_round

    strategy = pacfl_strategy(tmp_path)
    synthetic_round(strategy, synthetic_grid(6), 1, synthetic_client)
    strategy.artifacts()["proximity.png"](tmp_path / "proximity_again.png")
    fig = drawn["proximity_again.png"]
    off_diagonal = strategy.proximity[~np.eye(6, dtype=bool)]
    assert fig.axes[0].images[0].get_clim() == pytest.approx((off_diagonal.min(), off_diagonal.max()))
    assert "degrees" in fig.axes[-1].get_ylabel() and "colours span the data" in fig.axes[-1].get_ylabel()


# ---- dendrograms ---------------------------------------------------------------------------------------


def test_a_dendrogram_cut_by_number_of_clusters_shows_its_cut(drawn, tmp_path):
    """One-shot HFL and PACFL cut by num_clusters: no threshold, and no cut line was drawn."""
    points = np.concatenate([np.random.default_rng(3).normal(centre, 0.1, size=(5, 2)) for centre in (0, 3, 9)])
    hac = hierarchical_clustering(points, "l2", "average", num_clusters=3)
    record = ClusteringRecord.of(1, range(15), hac, "num_clusters 3")
    record.dendrogram(np.repeat(np.arange(3), 5), None, "one-shot")(tmp_path / "dendrogram.png")
    ax = drawn["dendrogram.png"].axes[0]
    (cut,) = [line for line in ax.get_lines() if line.get_label().startswith("cut")]
    height = cut.get_ydata()[0]
    assert cut.get_label() == f"cut: 3 clusters (height {height:.3g})"
    assert len(np.unique(fcluster(hac.linkage, t=height, criterion="distance"))) == 3  # the line cuts 3 clusters
    assert cut.get_label() in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_dendrogram_cut_by_threshold_draws_the_threshold(drawn, tmp_path):
    linkage = np.array([[0, 1, 1.0, 2], [2, 3, 2.0, 2], [4, 5, 5.0, 4]])
    plot_dendrogram(linkage, ["0:0", "1:0", "2:1", "3:1"], 3.5, tmp_path / "d.png", "flhc")
    (cut,) = [line for line in drawn["d.png"].axes[0].get_lines() if line.get_label().startswith("cut")]
    assert cut.get_label() == "cut: threshold 3.5" and set(cut.get_ydata()) == {3.5}


def random_linkage(count: int) -> np.ndarray:
    from scipy.cluster.hierarchy import linkage

    return linkage(np.random.default_rng(count).normal(size=(count, 3)), method="average")


def test_a_100_client_dendrogram_labels_every_leaf_at_a_readable_size(drawn, tmp_path):
    plot_dendrogram(random_linkage(100), [f"{p}:{p % 4}" for p in range(100)], None, tmp_path / "d.png", "t")
    fig = drawn["d.png"]
    ax = fig.axes[0]
    ticks = ax.get_xticklabels()
    assert len(ticks) == 100 and all(t.get_text() for t in ticks)
    assert min(t.get_fontsize() for t in ticks) >= 7
    renderer = fig.canvas.get_renderer()
    assert not overlapping(ticks, renderer)


def test_a_1000_client_dendrogram_labels_one_leaf_in_k_and_says_so(drawn, tmp_path):
    plot_dendrogram(random_linkage(1000), [f"{p}:{p % 4}" for p in range(1000)], None, tmp_path / "d.png", "t")
    fig = drawn["d.png"]
    ax = fig.axes[0]
    ticks = ax.get_xticklabels()
    labelled = [k for k, t in enumerate(ticks) if t.get_text()]
    assert labelled == list(range(0, 1000, 5)) and min(t.get_fontsize() for t in ticks) >= 7
    assert ax.get_xlabel() == "client:true cluster (1 leaf in 5 labelled, of 1000)"
    assert not overlapping([ticks[k] for k in labelled], fig.canvas.get_renderer())


# ---- the leaderboard -------------------------------------------------------------------------------------


def test_the_leaderboards_colour_bar_is_labelled_and_spans_the_data(drawn, tmp_path):
    leaderboard = load_benchmark("leaderboard/run.py")
    values = np.array([[0.67, 0.70], [0.97, np.nan], [0.82, 0.85]])
    leaderboard.heat_map(values, ["fedavg", "local", "oracle"], ["label_swap", "rotation"], "mean client accuracy",
                         tmp_path / "accuracy.png", "mean client accuracy, mean over seeds")
    fig = drawn["accuracy.png"]
    assert fig.axes[0].images[0].get_clim() == (0.67, 0.97)
    assert fig.axes[1].get_ylabel() == "mean client accuracy, mean over seeds (colours span the data: 0.67 to 0.97)"
    missing = [t for t in fig.axes[0].texts if t.get_text() == "–"]
    assert len(missing) == 1 and to_rgba(missing[0].get_color()) == to_rgba("black")  # white cell, dark mark
