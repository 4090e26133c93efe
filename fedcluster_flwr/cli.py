"""``fedcluster``: run experiments through Flower's simulation engine, compare and plot them.

    fedcluster run CONFIG [--set KEY=VALUE]... [--out DIR]
    fedcluster compare CONFIG --strategies fedavg,local,oracle,flhc [--set ...] [--out DIR]
    fedcluster run CONFIG --stop-after N [--set ...] --out BASE     (a prefix to branch from)
    fedcluster resume RUN_DIR [--rounds N] [--out NEW_DIR --set KEY=VALUE...]
    fedcluster plot RUN_DIR... [--out FILE]

User mistakes (bad config, missing data) print one ``error:`` line and exit with 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .config import ExperimentConfig, config_to_dict, load_config, parse_override
from .data import DataError
from .results import RoundRow, atomic_write, branch_run, plot_comparison, run_dir_name
from .schema import ConfigError, require

EXIT_USER_ERROR = 2


class RunFailed(RuntimeError):
    """The simulation ended without finishing all rounds."""


def run_experiment(
    config: ExperimentConfig,
    run_dir: Path,
    *,
    progress: bool = True,
    verbose: bool = False,
    announce: bool = False,
    resume_from: int = 0,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Run one experiment in-process on Flower's Ray simulation engine; return its summary.

    ``resume_from`` > 0 continues the run in ``run_dir`` from its checkpoint at that round;
    ``stop_after`` stops it, checkpointed, after that round (before ``config.rounds``).
    """
    from flwr.clientapp import ClientApp
    from flwr.simulation import run_simulation
    from tqdm import tqdm

    from .client_app import make_client_fn
    from .server_app import make_server_app

    if stop_after is not None:
        require(
            resume_from < stop_after < config.rounds,
            "--stop-after",
            f"must lie after round {resume_from} and before the last round ({config.rounds}), got {stop_after}",
        )
    preflight(config, run_dir, resuming=resume_from > 0)
    if announce:
        from .experiment import run_title

        stopping = "" if stop_after is None else f", stopping after round {stop_after}"
        print(f"fedcluster: {run_title(config)}, {config.rounds} rounds{stopping} -> {run_dir}", flush=True)
    last_round = config.rounds if stop_after is None else stop_after
    bar = tqdm(total=last_round, initial=resume_from, desc=config.strategy.name, unit="round", disable=not progress)

    def on_round(row: RoundRow) -> None:
        accuracy = row["mean_client_accuracy"]
        postfix = {"acc": "n/a" if accuracy is None else f"{accuracy:.3f}", "clusters": row["num_clusters"]}
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)

    backend_config = {
        "client_resources": {
            "num_cpus": config.simulation.num_cpus_per_client,
            "num_gpus": config.simulation.num_gpus_per_client,
        },
        "init_args": {"logging_level": "INFO" if verbose else "ERROR", "log_to_driver": verbose},
    }
    with _quiet(verbose):
        run_simulation(
            server_app=make_server_app(config, run_dir, on_round, resume=resume_from > 0, stop_after=stop_after),
            client_app=ClientApp(client_fn=make_client_fn(config)),
            num_supernodes=config.partition.num_clients,
            backend_config=backend_config,
            verbose_logging=verbose,
        )
    bar.close()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    done = summary["completed_rounds"] if summary else 0
    if done != last_round:
        raise RunFailed(
            f"the run stopped after {done} of {last_round} rounds; partial results in {run_dir} "
            f"(rerun with --verbose for Flower's and Ray's logs)"
        )
    return summary


def preflight(config: ExperimentConfig, run_dir: Path, resuming: bool = False) -> None:
    """Catch user mistakes before Ray starts: data, partition, GPU, a used results directory."""
    from .experiment import configure_torch, experiment_data

    if not resuming and run_dir.is_dir() and any(run_dir.iterdir()):
        raise ConfigError("--out", f"{run_dir} already holds files; give a new directory (results are never overwritten)")
    configure_torch(config)  # before this process's first torch operation; Ray workers inherit the pins
    experiment_data(config)


class _quiet:
    """Keep Flower's per-round INFO logs and known-harmless notices off the progress bar.

    ``run_simulation`` is deprecated in favour of ``flwr run`` but is the supported
    way to run a simulation in-process; the notice and Ray's accelerator tip are
    dropped unless ``--verbose``.
    """

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self._filter = _DropDeprecationNotice()

    def __enter__(self) -> None:
        from flwr.common.logger import FLOWER_LOGGER

        self._level = FLOWER_LOGGER.level
        if not self.verbose:
            FLOWER_LOGGER.setLevel(logging.WARNING)
            FLOWER_LOGGER.addFilter(self._filter)
            warnings.filterwarnings("ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO.*")

    def __exit__(self, *exc: object) -> None:
        from flwr.common.logger import FLOWER_LOGGER

        FLOWER_LOGGER.setLevel(self._level)
        FLOWER_LOGGER.removeFilter(self._filter)


class _DropDeprecationNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "DEPRECATED FEATURE" not in record.getMessage()


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
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
        f"  clients over target    {over} (target {target:g}; the mean reached it "
        f"{'at round ' + str(reached) if reached else 'never'})",
        f"  clusters               {summary.get('num_clusters')} ({scores})",
        f"  per-cluster accuracy   {by_cluster('per_cluster_accuracy')}",
        f"  per true cluster       {by_cluster('per_true_cluster_accuracy')}",
        f"  communication          up {summary['bytes_up'] / 1e6:.1f} MB, down {summary['bytes_down'] / 1e6:.1f} MB",
        f"  failures               {summary['fit_failures']} failed fits, {summary['rejected_updates']} rejected updates",
        f"  wall time              {summary['wall_seconds']:.1f} s",
        f"  results                {run_dir}",
    ]
    return "\n".join(lines)


def _load(args: argparse.Namespace) -> ExperimentConfig:
    config, notes = load_config(args.config, [parse_override(item) for item in args.set])
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return config


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    run_dir = Path(args.out) if args.out else Path(config.output_dir) / run_dir_name(
        config.strategy.name, config.dataset.name, config.partition.name
    )
    run_dir = run_dir.resolve()
    summary = run_experiment(
        config, run_dir, progress=not args.no_progress, verbose=args.verbose, announce=True,
        stop_after=args.stop_after,
    )
    if args.stop_after is not None:
        print(
            f"stopped after round {args.stop_after} of {config.rounds}, checkpointed in {run_dir}\n"
            f"  continue it:  fedcluster resume {run_dir}\n"
            f"  branch it:    fedcluster resume {run_dir} --out NEW_DIR --set strategy.KEY=VALUE"
        )
        return 0
    print(format_summary(summary, run_dir))
    return 0


# What produced a checkpoint; a branch that changed one of these would continue a run that never happened.
BRANCH_FIXED = ("dataset", "partition", "model", "client", "seed")


def first_difference(before: Any, after: Any, key: str) -> str | None:
    """The dotted key of the first value that differs between two resolved config trees."""
    if isinstance(before, dict) and isinstance(after, dict):
        for name in sorted(set(before) | set(after)):
            found = first_difference(before.get(name), after.get(name), f"{key}.{name}")
            if found:
                return found
        return None
    return None if before == after else key


def check_branch(before: ExperimentConfig, after: ExperimentConfig, state: dict[str, Any]) -> None:
    """Refuse a branch that changes what produced the checkpoint: the experiment (data, model,
    training, seed), the strategy, or a strategy option the run already acted on."""
    from .strategies import STRATEGIES

    old, new = config_to_dict(before), config_to_dict(after)
    for section in BRANCH_FIXED:
        changed = first_difference(old[section], new[section], section)
        require(
            changed is None,
            changed or section,
            "a branch continues the checkpoint of RUN_DIR, so it cannot change what produced it "
            f"({', '.join(BRANCH_FIXED)}, strategy.name); start a new run instead",
        )
    require(before.strategy.name == after.strategy.name, "strategy.name",
            f"a branch continues the {before.strategy.name} checkpoint of RUN_DIR; start a new run for another strategy")
    for option in STRATEGIES[before.strategy.name].options_fixed_by(state):
        require(
            getattr(before.strategy.options, option) == getattr(after.strategy.options, option),
            f"strategy.{option}",
            f"the run already acted on it by round {state['round']} (the checkpoint); branch from an earlier "
            "checkpoint (fedcluster run --stop-after N) to vary it",
        )


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a run from its checkpoint (to its configured rounds, or to --rounds); with --out,
    continue a copy of it instead (a branch), optionally with changed options (--set)."""
    summary, run_dir = continue_run(
        Path(args.run_dir), out=Path(args.out) if args.out else None, overrides=args.set, rounds=args.rounds,
        progress=not args.no_progress, verbose=args.verbose,
    )
    print(format_summary(summary, run_dir))
    return 0


def continue_run(
    run_dir: Path,
    *,
    out: Path | None = None,
    overrides: Sequence[str] = (),
    rounds: int | None = None,
    progress: bool = True,
    verbose: bool = False,
) -> tuple[dict[str, Any], Path]:
    """Resume ``run_dir`` from its checkpoint, or, with ``out``, a branch of it there with
    ``overrides`` (``KEY=VALUE``) applied; return the summary and the directory that ran."""
    run_dir = run_dir.resolve()
    checkpoint = run_dir / "checkpoint" / "state.json"
    if not checkpoint.is_file():
        raise ConfigError("RUN_DIR", f"{run_dir} has no checkpoint/state.json to resume from")
    state = json.loads(checkpoint.read_text())
    done = int(state["round"])
    parsed = [parse_override(item) for item in overrides]
    require(
        not parsed or out is not None,
        "--set",
        "changed options need --out NEW_DIR: RUN_DIR keeps the run as it ran and the changed continuation is a branch of it",
    )
    require(rounds is None or rounds >= 1, "--rounds", f"must be >= 1, got {rounds}")
    before, _ = load_config(run_dir / "config.yaml", [])
    config, notes = load_config(run_dir / "config.yaml", parsed + ([("rounds", rounds)] if rounds else []))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    check_branch(before, config, state)
    if config.rounds <= done:
        raise ConfigError(
            "rounds" if any(key == "rounds" for key, _ in parsed) and not rounds else "--rounds",
            f"the checkpoint is at round {done} of {config.rounds}; pass --rounds N > {done} to extend",
        )
    if out is not None:
        target = out.resolve()
        preflight(config, target, resuming=True)  # a missing dataset is reported before anything is copied
        try:
            branch_run(run_dir, target, config_to_dict(config), done, overrides)
        except FileExistsError as err:
            raise ConfigError("--out", str(err)) from None
        run_dir = target
    elif rounds:
        atomic_write(run_dir / "config.yaml", yaml.safe_dump(config_to_dict(config), sort_keys=False))
    summary = run_experiment(config, run_dir, progress=progress, verbose=verbose, announce=True, resume_from=done)
    return summary, run_dir


def cmd_compare(args: argparse.Namespace) -> int:
    """Run several strategies on the same config (same partitions, seeds and model init)."""
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise ConfigError("--strategies", "give at least one strategy name, e.g. fedavg,flhc")
    configs = {}
    for name in names:
        args.set = [*args.base_set, f"strategy.name={name}"]
        configs[name] = _load(args)
    first = next(iter(configs.values()))
    out = Path(args.out or Path(first.output_dir) / run_dir_name("compare", first.dataset.name, first.partition.name))
    out = out.resolve()
    rows = []
    for name, config in configs.items():
        print(f"fedcluster compare: {name} ({names.index(name) + 1}/{len(names)})")
        summary = run_experiment(config, out / name, progress=not args.no_progress, verbose=args.verbose, announce=True)
        print(format_summary(summary, out / name))
        rows.append((name, summary))
    table = comparison_table(rows)
    (out / "comparison.md").write_text(table + "\n")
    plot_comparison([out / name for name, _ in rows], out / "comparison.png")
    print(table)
    print(f"\nwritten: {out / 'comparison.md'}, {out / 'comparison.png'}")
    return 0


def comparison_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    header = (
        "| strategy | mean client acc. | best | % clients ≥ target | rounds to target | clusters | purity | ARI | MB up | wall s |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    def fmt(value: Any, spec: str) -> str:
        return "–" if value is None else format(value, spec)
    lines = [header] + [
        f"| {name} | {fmt(s.get('mean_client_accuracy'), '.4f')} | {fmt(s.get('best_mean_client_accuracy'), '.4f')} "
        f"| {fmt(s.get('pct_clients_over_target'), '.1f')} | {fmt(s.get('rounds_to_target'), 'd')} "
        f"| {s.get('num_clusters')} | {fmt(s.get('purity'), '.2f')} | {fmt(s.get('ari'), '.2f')} "
        f"| {s['bytes_up'] / 1e6:.1f} | {s['wall_seconds']:.0f} |"
        for name, s in rows
    ]
    return "\n".join(lines)


def cmd_plot(args: argparse.Namespace) -> int:
    run_dirs = [Path(p) for p in args.run_dirs]
    for run_dir in run_dirs:
        if not all((run_dir / name).is_file() for name in ("rounds.jsonl", "config.yaml")):
            raise ConfigError("RUN_DIR", f"{run_dir} has no rounds.jsonl and config.yaml (is it a fedcluster run?)")
    plot_comparison(run_dirs, Path(args.out))
    print(f"written: {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedcluster", description="Clustered federated learning on Flower.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_run_options(p: argparse.ArgumentParser, set_dest: str) -> None:
        p.add_argument("config", help="experiment YAML (e.g. conf/default.yaml)")
        p.add_argument("--set", dest=set_dest, action="append", default=[], metavar="KEY=VALUE",
                       help="override a dotted config key, e.g. --set strategy.name=fedavg (repeatable)")
        p.add_argument("--out", help="results directory (default: <output_dir>/<timestamp>_<...>)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")

    run = sub.add_parser("run", help="run one experiment")
    add_run_options(run, "set")
    run.add_argument("--stop-after", type=int, metavar="N",
                     help="stop after round N with a checkpoint, to resume or branch later (e.g. a shared prefix of a sweep)")
    run.set_defaults(func=cmd_run)

    resume = sub.add_parser("resume", help="continue a run from its checkpoint")
    resume.add_argument("run_dir", metavar="RUN_DIR")
    resume.add_argument("--rounds", type=int, help="extend the run to this many rounds")
    resume.add_argument("--out", metavar="NEW_DIR",
                        help="continue a copy of the run here (a branch) and leave RUN_DIR as it is")
    resume.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --out: change an option for the continuation, e.g. --set strategy.threshold=250 (repeatable)")
    resume.add_argument("--no-progress", action="store_true", help="no progress bar")
    resume.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")
    resume.set_defaults(func=cmd_resume)

    compare = sub.add_parser("compare", help="run several strategies on the same partitions")
    add_run_options(compare, "base_set")
    compare.add_argument("--strategies", required=True, help="comma-separated strategy names")
    compare.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="plot the mean client accuracy of several runs")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", default="comparison.png", help="image file to write")
    plot.set_defaults(func=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; results written so far are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
