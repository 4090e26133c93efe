"""The ``fedcluster`` commands: the parser and one function per command (``fedcluster --help``).

    fedcluster run CONFIG [--set KEY=VALUE]... [--out DIR] [--dry-run]
    fedcluster compare CONFIG --strategies fedavg,local,oracle,flhc [--set ...] [--out DIR]
    fedcluster run CONFIG --stop-after N [--set ...] --out BASE     (a prefix to branch from)
    fedcluster resume RUN_DIR [--rounds N] [--out NEW_DIR --set KEY=VALUE...]
    fedcluster plot RUN_DIR... [--out FILE]
    fedcluster export-partitions CONFIG DIR [--set KEY=VALUE]... [--images]

This module parses the command line and prints; :mod:`fedcluster_flwr.runner` runs, resumes and
branches, and :mod:`fedcluster_flwr.cli.console` (the console script) imports this module only once stop
signals are handled. User mistakes (bad config, missing data) print one ``error:`` line and exit
with 2; a run stopped by Ctrl-C, SIGTERM or SIGHUP prints one line naming its results and the
``fedcluster resume`` that continues it, and exits with 128 + the signal (130, 143, 129), nothing
of it left running.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .. import runner
from ..config.load import ConfigWarning, config_differences, config_to_dict, keys_set_in, load_config, parse_override
from ..config.sections import ExperimentConfig
from ..config.cost import estimate_cost
from ..data import DataError
from ..results.files import atomic_write
from ..results.provenance import package_version
from ..plots import plot_comparison
from ..results.recorder import run_dir_name
from ..results.run_files import RoundRow, format_summary, read_summary, run_curves
from ..declarations.schema import ConfigError, InRegistry, config_keys, lookup
from ..registry import strategies

EXIT_USER_ERROR = 2


class ConsoleProgress:
    """What ``fedcluster`` shows of a running run: a line naming it, then (``bar``; not with
    ``--no-progress``) a bar of its rounds with the mean client accuracy and the cluster count."""

    def __init__(self, bar: bool) -> None:
        self.show_bar = bar
        self._tqdm = None

    def start(self, config: ExperimentConfig, run_dir: Path, completed_round: int, last_round: int) -> None:
        from tqdm import tqdm

        from ..plots import run_title

        stopping = "" if last_round == config.rounds else f", stopping after round {last_round}"
        print(f"fedcluster: {run_title(config)}, {config.rounds} rounds{stopping} -> {run_dir}", flush=True)
        self._tqdm = tqdm(total=last_round, initial=completed_round, desc=config.strategy.name, unit="round",
                         disable=not self.show_bar)

    def round_done(self, row: RoundRow) -> None:
        accuracy = row["mean_client_accuracy"]
        postfix = {"acc": "n/a" if accuracy is None else f"{accuracy:.3f}", "clusters": row["num_clusters"]}
        self._tqdm.set_postfix(postfix, refresh=False)
        self._tqdm.update(1)

    def close(self) -> None:
        self._tqdm.close()


def _load(args: argparse.Namespace) -> ExperimentConfig:
    config, notes = load_config(args.config, [parse_override(item) for item in args.set], strict=True)
    _print_notes(notes)
    return config


def _print_notes(notes: Sequence[str]) -> None:
    for note in notes:
        print(f"{'warning' if isinstance(note, ConfigWarning) else 'note'}: {note}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    if args.dry_run:  # as YAML, so that the output is a config file that runs as this run would
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        print(f"# cost: {estimate_cost(config).text()}")
        return 0
    run_dir = Path(args.out) if args.out else Path(config.output_dir) / run_dir_name(
        config.strategy.name, config.dataset.name, config.partition.name
    )
    run_dir = run_dir.resolve()
    progress = ConsoleProgress(bar=not args.no_progress)
    summary = runner.run_experiment(config, run_dir, progress=progress, verbose=args.verbose, stop_after=args.stop_after)
    if args.stop_after is not None:
        print(
            f"stopped after round {args.stop_after} of {config.rounds}, checkpointed in {run_dir}\n"
            f"  continue it:  fedcluster resume {run_dir}\n"
            f"  branch it:    fedcluster resume {run_dir} --out NEW_DIR --set strategy.KEY=VALUE"
        )
        return 0
    print(format_summary(summary, run_dir))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a run from its checkpoint (to its configured rounds, or to --rounds); with --out,
    continue a copy of it instead (a branch), optionally with changed options (--set)."""
    continuation = runner.plan_continuation(
        Path(args.run_dir), out=Path(args.out) if args.out else None, overrides=args.set, rounds=args.rounds
    )
    _print_notes(continuation.notes)
    progress = ConsoleProgress(bar=not args.no_progress)
    summary = runner.continue_run(continuation, progress=progress, verbose=args.verbose)
    print(format_summary(summary, continuation.run_dir))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Run several strategies on the same config (same partitions, seeds and model init), each in
    ``OUT/<strategy>``. Run again with the same ``--out``, it completes a comparison that was
    stopped: finished strategies are kept, a stopped one resumes from its checkpoint, the missing
    ones run."""
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise ConfigError("--strategies", "give at least one strategy name, e.g. fedavg,flhc")
    for name in names:
        unknown = InRegistry(strategies(), "strategy").violation(name)
        if unknown:
            raise ConfigError("--strategies", unknown)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError("--strategies", f"{', '.join(repeated)} given twice; each strategy runs once")
    base = [parse_override(item) for item in args.base_set]
    check_compared_options(base, names)
    configs = {}
    for name in names:
        # Not strict: a --set option of one compared strategy is only a note for the others.
        config, notes = load_config(args.config, [*base, ("strategy.name", name)])
        _print_notes(notes)
        configs[name] = config
    first = next(iter(configs.values()))
    out = Path(args.out or Path(first.output_dir) / run_dir_name("compare", first.dataset.name, first.partition.name))
    out = out.resolve()
    rows = []
    for name, config in configs.items():
        print(f"fedcluster compare: {name} ({names.index(name) + 1}/{len(names)})")
        try:
            summary = _compare_one(config, out / name, args)
        except runner.Interrupted:
            print(f"to complete the comparison later, run it again with --out {out}", file=sys.stderr)
            raise
        print(format_summary(summary, out / name))
        rows.append((name, summary))
    table = comparison_table(rows)
    atomic_write(out / "comparison.md", table + "\n")
    plot_comparison(run_curves([out / name for name, _ in rows]), out / "comparison.png")
    print(table)
    print(f"\nwritten: {out / 'comparison.md'}, {out / 'comparison.png'}")
    return 0


def check_compared_options(overrides: Sequence[tuple[str, Any]], names: Sequence[str]) -> None:
    """A ``--set strategy.KEY`` of ``fedcluster compare`` must be an option of at least one compared
    strategy (each of the others ignores it with a note); a key no strategy has is left to the
    config's unknown-key error, which suggests a spelling."""
    compared = {key for name in names for key in config_keys(strategies()[name].Options)} | {"name"}
    for key in sorted(keys_set_in("strategy", overrides) - compared):
        owners = [name for name, cls in strategies().items() if key in config_keys(cls.Options)]
        if owners:
            raise ConfigError(f"strategy.{key}", f"not an option of any compared strategy ({', '.join(names)}; it is "
                              f"one of {', '.join(owners)}): drop it, or compare a strategy that has it")


def _compare_one(config: ExperimentConfig, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One strategy of a comparison in ``run_dir``: its summary if it finished there before, else
    its run resumed from the checkpoint it left there, else a new run."""
    progress = ConsoleProgress(bar=not args.no_progress)
    if not (run_dir.is_dir() and any(run_dir.iterdir())):
        return runner.run_experiment(config, run_dir, progress=progress, verbose=args.verbose)
    earlier, _ = load_config(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else (None, [])
    # how the rounds execute may differ (a stopped comparison finished on another engine), not what they compute
    execution = {key: lookup(config, key) for key in runner.EXECUTION_KEYS}
    changed = [] if earlier is None else config_differences(
        config_to_dict(earlier), config_to_dict(config), runner.EXECUTION_KEYS)
    if earlier is None or changed:
        what = "no config.yaml" if earlier is None else f"a run whose {changed[0][0]} differs from this comparison's"
        raise ConfigError("--out", f"{run_dir} holds {what}: give a new --out, or the options of the comparison it holds")
    summary = read_summary(run_dir)
    if summary.get("finished") is True:
        print(f"  already finished in {run_dir}; kept")
        return summary
    moved = [f"{key}={json.dumps(value)}" for key, value in execution.items() if lookup(earlier, key) != value]
    continuation = runner.plan_continuation(run_dir, overrides=moved)  # refuses a run stopped before its first checkpoint
    return runner.continue_run(continuation, progress=progress, verbose=args.verbose)


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
    plot_comparison(run_curves(run_dirs), Path(args.out))
    print(f"written: {args.out}")
    return 0


def cmd_export_partitions(args: argparse.Namespace) -> int:
    """Write every simulated client's data as a device's data folder (see export.py)."""
    from ..data.device import MANIFEST_FILE
    from .export import export_partitions

    config = _load(args)
    manifest = export_partitions(config, Path(args.dir), images=args.images)
    out = Path(args.dir).resolve()
    print(f"exported {manifest['num_clients']} clients of {manifest['dataset']} to {out} "
          f"(config {manifest['config_hash'][:12]}; {MANIFEST_FILE} lists each client's node config)")
    first = manifest["clients"][0]
    print(f"  e.g. flower-supernode ... --node-config \"{first['node_config']}\"")
    return 0


def _strategy_names() -> str:
    """The registered names, for a help text: a family that fails to import is reported when a
    command needs the registry, not while the parser is built."""
    try:
        return ", ".join(strategies())
    except ConfigError as err:
        return f"(the registry could not be loaded: {err})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedcluster", description="Clustered federated learning on Flower.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
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
    run.add_argument("--dry-run", action="store_true",
                     help="print the resolved config (as YAML) and what the run will cost, in client-sample passes, "
                     "and stop without running")
    run.set_defaults(func=cmd_run)

    resume = sub.add_parser("resume", help="continue a run from its checkpoint")
    resume.add_argument("run_dir", metavar="RUN_DIR")
    resume.add_argument("--rounds", type=int, help="extend the run to this many rounds")
    resume.add_argument("--out", metavar="NEW_DIR",
                        help="continue a copy of the run here (a branch) and leave RUN_DIR as it is")
    resume.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --out: change an option for the continuation, e.g. --set strategy.threshold=250 (repeatable); "
                        f"without it only {', '.join(runner.EXECUTION_KEYS)}")
    resume.add_argument("--no-progress", action="store_true", help="no progress bar")
    resume.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")
    resume.set_defaults(func=cmd_resume)

    compare = sub.add_parser("compare", help="run several strategies on the same partitions")
    add_run_options(compare, "base_set")
    compare.add_argument("--strategies", required=True, metavar="NAME,NAME,...",
                         help=f"comma-separated strategy names, each run on the same partitions: {_strategy_names()}")
    compare.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="plot the mean client accuracy of several runs")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", default="comparison.png", help="image file to write")
    plot.set_defaults(func=cmd_plot)

    export = sub.add_parser("export-partitions", help="write each simulated client's data for a device (data-dir)")
    export.add_argument("config", help="experiment YAML (e.g. conf/default.yaml)")
    export.add_argument("dir", metavar="DIR", help="folder to write client_<i>/data.npz and manifest.json into")
    export.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a dotted config key, as for run (repeatable)")
    export.add_argument("--images", action="store_true",
                        help="also write train/<label>/*.png and test/<label>/*.png (8-bit: not bit-exact)")
    export.set_defaults(func=cmd_export_partitions)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run its command; a user's mistake is one ``error:`` line and exit code 2,
    a failed run 1, a stopped one 128 + the signal. A stop signal outside a run is
    :func:`fedcluster_flwr.cli.console.main`'s to report."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except runner.RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except runner.Interrupted as stop:  # the run, Ray and all it started have ended; say how to resume
        print(str(stop), file=sys.stderr)
        return stop.exit_code
