"""Experiment configuration: YAML file + dotted ``key=value`` overrides -> typed config.

The YAML has the sections ``dataset``, ``partition``, ``model``, ``client``,
``strategy``, ``simulation`` and ``faults`` plus a few top-level keys, declared in
:mod:`fedcluster_flwr.config.sections`; this module reads, overrides, checks and builds them
(and turns a config back into plain data). ``partition`` and
``strategy`` take the options of the partitioner / strategy they name. A key that
belongs to a *different* registered partitioner or strategy is ignored with a
note; a key that belongs to none is an error.

The YAML is read by :mod:`fedcluster_flwr.config.file`, which refuses what a config cannot mean
(a key given twice, aliases, a file too big); a config whose run would cost far more than any
experiment here (:mod:`fedcluster_flwr.config.cost`) loads with a warning.

Swapping strategies (:func:`swap_strategy`): an override that changes ``strategy.name`` keeps of
the YAML's strategy options only those that mean the same for the new strategy
(options declared with the role ``SAME_MEANING``, :mod:`fedcluster_flwr.declarations.roles`, and options
both inherit from one declaration); the others are
dropped with a note, since a value written for one algorithm (FL+HC's l1 ``threshold: 20``) is
not a value for another (one-shot's ``threshold`` on 1 - R in (0, 1)).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .file import parse_value, read_yaml
from ..declarations.roles import SAME_MEANING
from .sections import PARTITION_COMMON, ExperimentConfig, PartitionConfig, SimulationConfig, StrategyConfig
from .cost import POOL_SIZES, estimate_cost
from ..data.partition_options import group_count
from ..data.partitions import PARTITIONERS
from ..models import MODELS
from ..declarations.options import check_in_experiment, from_mapping, to_plain
from ..declarations.schema import ConfigError, InRegistry, OnlyWith, as_yaml, config_key, config_keys, describe, require, unknown_key_message
from ..registry import strategies


# ---- overrides ---------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Any]:
    """``"strategy.threshold=3.5"`` -> ``("strategy.threshold", 3.5)``."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", f"expected KEY=VALUE with a dotted KEY (e.g. rounds=20), got {text!r}")
    return key, parse_value(value.strip(), key)


def apply_overrides(raw: dict[str, Any], overrides: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each dotted ``(key, value)`` set."""
    merged = _deep_copy(raw)
    for key, value in overrides:
        parts = key.split(".")
        node = merged
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: depth + 1]), f"is a value, cannot set {key} inside it")
            node = child
        node[parts[-1]] = value
    return merged


def config_differences(
    before: Any, after: Any, ignore: Collection[str] = (), key: str = ""
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, before, after)`` of every value that differs between two resolved config trees
    (:func:`config_to_dict`'s), in key order, leaving out the dotted keys in ``ignore``."""
    if key in ignore:
        return []
    if isinstance(before, dict) and isinstance(after, dict):
        return [found for name in sorted(set(before) | set(after))
                for found in config_differences(before.get(name), after.get(name), ignore, f"{key}.{name}" if key else name)]
    return [] if before == after else [(key, before, after)]


def tree_at(tree: Any, dotted: str) -> Any:
    """The value at ``dotted`` of a plain config tree (:func:`config_to_dict`'s); None if absent."""
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def left_with_engine(
    simulation: SimulationConfig, overrides: Sequence[tuple[str, Any]]
) -> tuple[list[tuple[str, Any]], list[str]]:
    """The overrides (``None``) of the settings ``simulation`` holds that its declared rules let only
    another engine take than the one ``overrides`` move it to (the batched engine's workers, Ray's
    cluster address), and a note for each: what the moved run leaves behind. A setting the
    overrides set themselves stays, so that a contradiction the user typed is still reported."""
    engine = apply_overrides({"simulation": {"engine": simulation.engine}}, overrides)["simulation"].get("engine")
    typed = keys_set_in("simulation", overrides)
    left, notes = [], []
    for rule in SimulationConfig.rules:
        if (isinstance(rule, OnlyWith) and isinstance(rule.subject, str) and rule.condition.name == "engine"
                and engine not in rule.condition.values and getattr(simulation, rule.subject) is not None
                and rule.subject not in typed):
            left.append((f"simulation.{rule.subject}", None))
            notes.append(f"simulation.{rule.subject}: {as_yaml(getattr(simulation, rule.subject))} dropped (a setting "
                         f"of another engine; the run moves to simulation.engine {engine})")
    return left, notes


def keys_set_in(section: str, overrides: Iterable[tuple[str, Any]]) -> set[str]:
    """The keys of ``section`` that ``overrides`` set: ``strategy.tau=3`` and ``strategy={tau: 3}``
    both set ``tau``."""
    keys = set()
    for key, value in overrides:
        head, _, rest = key.partition(".")
        if head != section:
            continue
        if rest:
            keys.add(rest.split(".")[0])
        elif isinstance(value, Mapping):
            keys.update(str(k) for k in value)
    return keys


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---- building ----------------------------------------------------------------------


def _split_named_section(
    raw: Any, section: str, registry: Mapping[str, Any], options_of: Any, common: set[str], notes: list[str],
    given: Iterable[str] = (),
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Split a ``partition``/``strategy`` mapping into (name, common keys, option keys). A key of
    another entry of the registry is ignored with a note where the YAML has it (a file may be
    shared between strategies) and an error where ``given`` (keys set on the command line) has it:
    there it was typed for this run."""
    if not isinstance(raw, Mapping):
        raise ConfigError(section, f"expected a mapping of keys, got {describe(raw)}")
    name = raw.get("name")
    if name is None:
        raise ConfigError(f"{section}.name", f"is required; one of {', '.join(registry)}")
    unknown = InRegistry(registry, section).violation(name)
    if unknown:
        raise ConfigError(f"{section}.name", unknown)
    own = set(config_keys(options_of(registry[name])))
    others = {key for entry in registry.values() for key in config_keys(options_of(entry))}
    common_values, option_values = {}, {}
    for key, value in raw.items():
        if key in common:
            common_values[key] = value
        elif key in own:
            option_values[key] = value
        elif key in others and key in given:
            owners = [entry for entry, value in registry.items() if key in config_keys(options_of(value))]
            raise ForeignOptionError(
                f"{section}.{key}",
                f"not an option of {section} '{name}' (it is one of {', '.join(owners)}): drop it, "
                f"or set {section}.name to one of those",
            )
        elif key in others:
            notes.append(f"{section}.{key} ignored: not an option of {section} '{name}'")
        else:
            allowed = sorted(common | own)
            raise ConfigError(f"{section}.{key}", unknown_key_message(str(key), allowed, f"for {section} '{name}'"))
    return name, common_values, option_values


class ForeignOptionError(ConfigError):
    """An option of another strategy, set on the command line for this run."""


def build_config(
    raw: Mapping[str, Any], given: Iterable[tuple[str, Any]] = (), registered: Mapping[str, type] | None = None
) -> tuple[ExperimentConfig, list[str]]:
    """Validate a merged raw mapping; return the config and notes on ignored keys. ``given``: the
    overrides in it that were set on the command line, where another strategy's option is an error
    rather than a note (another partitioner's stays a note for now: issue #34 asked it of
    strategies). ``registered``: the registry's strategies as :func:`load_config` read them (else
    read here); the class ``strategy.name`` selects travels with the config
    (``StrategyConfig.strategy_class``), so that nothing after asks the registry again."""
    notes: list[str] = []
    given = list(given)
    part_name, part_common, part_opts = _split_named_section(
        raw.get("partition", {"name": "iid"}), "partition", PARTITIONERS,
        lambda p: p.options, PARTITION_COMMON, notes,
    )
    partition = from_mapping(
        PartitionConfig, part_common, "partition",
        built={"options": from_mapping(PARTITIONERS[part_name].options, part_opts, "partition")},
    )
    registered = strategies() if registered is None else registered
    strat_name, _, strat_opts = _split_named_section(
        raw.get("strategy", {"name": "fedavg"}), "strategy", registered,
        lambda s: s.Options, {"name"}, notes, keys_set_in("strategy", given),
    )
    strategy_class = registered[strat_name]
    strategy = StrategyConfig(strat_name, from_mapping(strategy_class.Options, strat_opts, "strategy"), strategy_class)
    if "model" not in raw:
        raise ConfigError("model.name", f"is required; one of {', '.join(MODELS)}")
    config = from_mapping(ExperimentConfig, raw, built={"partition": partition, "strategy": strategy})
    _check_experiment(config)
    return config, notes + _warnings(config)


class ConfigWarning(str):
    """A note about a config that runs but probably not as meant; shown as ``warning:``."""


def _warnings(config: ExperimentConfig) -> list[str]:
    """What runs but probably not as meant: a run far longer than any experiment here
    (:mod:`fedcluster_flwr.config.cost`: a typo such as ``client.epochs=1000000000``, or a setting worth a
    second look); fewer clients than the partition's groups leave groups without a client (a study
    of few clients may want exactly that, so no error)."""
    cost = estimate_cost(config)
    notes = [ConfigWarning(f"a very long run: {cost.text()}; check those options (fedcluster run --dry-run "
                           "shows them), or stop it with Ctrl-C and resume it later")] if cost.too_costly else []
    notes += _few_evaluation_examples(config)
    counted = group_count(config.partition.options)
    if counted is None:
        return notes
    key, groups = counted
    clients = config.partition.num_clients
    if clients >= groups:
        return notes
    return notes + [ConfigWarning(
        f"partition.num_clients ({clients}) is below the {groups} groups of partition.{key}: "
        f"{groups - clients} group(s) get no client; set partition.num_clients to at least {groups} to have them all"
    )]


# Fewer test (or validation) examples than this per client is worth a warning, not an error: a
# judgement call (below it a client's accuracy moves in steps of 10 points or more); none at all is
# an error (data.partitions.check_split_sizes).
MIN_EVALUATION_EXAMPLES = 10


def _few_evaluation_examples(config: ExperimentConfig) -> list[str]:
    """A warning where ``partition.test_fraction`` (or ``val_fraction``) leaves a client of about
    the mean size fewer than :data:`MIN_EVALUATION_EXAMPLES` examples, from the config alone (the
    samples per client as :mod:`fedcluster_flwr.config.cost` estimates them); none where it cannot say."""
    partition = config.partition
    pool = POOL_SIZES.get(config.dataset.name)
    samples = partition.samples_per_client or (pool // partition.num_clients if pool else 0)
    notes = []
    for key, split, fraction in (("test_fraction", "test", partition.test_fraction),
                                 ("val_fraction", "validation", partition.val_fraction)):
        count = round(samples * fraction)
        if fraction > 0 and 1 <= count < MIN_EVALUATION_EXAMPLES:
            share = MIN_EVALUATION_EXAMPLES / samples
            remedy = f"partition.{key} >= {share:.2g}" if share < 0.5 else "more samples per client"
            notes.append(ConfigWarning(
                f"partition.{key} {fraction:g} leaves a client about {count} {split} example{'s' * (count > 1)} "
                f"(of ~{samples} samples): its accuracy moves in steps of {100 / count:.0f} points; "
                f"{MIN_EVALUATION_EXAMPLES} need {remedy}"))
    return notes


def _check_experiment(config: ExperimentConfig) -> None:
    """Checks that span sections."""
    from ..models import model_outline

    shape, num_classes = config.input_shape, config.num_classes  # outside the try: an hf dataset's error is its own
    try:
        model_outline(config.model.name, shape, num_classes)
    except ValueError as err:
        raise ConfigError(
            "model.name",
            f"'{config.model.name}' cannot take {config.dataset.name}'s inputs of shape "
            f"{config.input_shape}: {err}",
        ) from None
    num_clients = config.partition.num_clients
    for key, mapping in (("simulation.fail_fit", config.simulation.fail_fit), ("simulation.join_round", config.simulation.join_round)):
        for pid in mapping:
            require(0 <= pid < num_clients, f"{key}.{pid}", f"partition ids run from 0 to {num_clients - 1}")
    for pid, first in config.simulation.join_round.items():
        require(first <= config.rounds, f"simulation.join_round.{pid}",
                f"round {first} comes after the last round ({config.rounds}): the client would never be online")
    for pid, rounds in config.simulation.fail_fit.items():
        require(max(rounds, default=1) <= config.rounds, f"simulation.fail_fit.{pid}",
                f"round {max(rounds, default=1)} comes after the last round ({config.rounds}): that failure would "
                "never be injected")
    check_in_experiment(config.partition.options, config, "partition")
    check_in_experiment(config.strategy.options, config, "strategy")


def load_config(
    path: str | Path | None, overrides: Iterable[tuple[str, Any]] = (), *, strict: bool = False
) -> tuple[ExperimentConfig, list[str]]:
    """Read YAML ``path`` (or start empty), apply dotted overrides, validate. An override of
    ``strategy.name`` swaps the strategy (:func:`swap_strategy`). An option of another strategy is
    ignored with a note; with ``strict`` (overrides the user typed for this one run: ``--set``,
    ``flwr run``'s ``set``) such an override is an error. Not strict elsewhere: one list of
    overrides may serve several strategies (``fedcluster compare``, which checks them itself; sweeps)."""
    raw = read_yaml(path) if path is not None else {}
    overrides = list(overrides)
    registered = strategies()  # the registry's one reading between the YAML and the strategy's constructor
    raw, swap = swap_strategy(raw, overrides, registered)
    try:
        config, notes = build_config(apply_overrides(raw, overrides), overrides if strict else (), registered)
    except ConfigError as err:
        given = any(key == err.key for key, _ in overrides)  # the command gave it: no hint to give it
        if swap is None or given or not err.key.startswith("strategy.") or isinstance(err, ForeignOptionError):
            raise
        raise ConfigError(err.key, f"{err.message} ({swap.hint(err.key)})") from None
    return config, ([swap.note()] if swap is not None and swap.dropped else []) + notes


def _declared_by(options: type, name: str) -> type:
    """The most basic class among ``options`` and its bases that declares field ``name``."""
    return next(cls for cls in reversed(options.__mro__) if name in inspect.get_annotations(cls))


def carries_over(name: str, old: type, new: type) -> bool:
    """Whether option ``name`` (a field name) of strategy class ``old`` keeps its meaning in ``new``:
    both declare it with :data:`~fedcluster_flwr.declarations.roles.SAME_MEANING` (the share of clients that
    train per round, the number of clusters: :func:`~fedcluster_flwr.declarations.roles.same_meaning_options`),
    or both inherit it from one declaration (one family: ifca/gradloss, the gossip strategies, the
    hierarchical ones)."""
    old_field = next((f for f in dataclasses.fields(old.Options) if f.name == name), None)
    new_field = next((f for f in dataclasses.fields(new.Options) if f.name == name), None)
    if new_field is None:
        return False
    if old_field is not None and SAME_MEANING.declared_by(old_field) and SAME_MEANING.declared_by(new_field):
        return True
    return _declared_by(old.Options, name) is _declared_by(new.Options, name)


@dataclass(frozen=True)
class StrategySwap:
    """An override changed ``strategy.name`` from the YAML's ``old`` to ``new``."""

    old: str
    new: str
    kept: tuple[str, ...]  # YAML keys of old's options that mean the same for new
    dropped: tuple[str, ...]  # the YAML's other options of old, left out

    def note(self) -> str:
        kept = f"; kept {', '.join(self.kept)}" if self.kept else ""
        return f"strategy.name={self.new} replaces the YAML's {self.old}: dropped its options {', '.join(self.dropped)}{kept}"

    def hint(self, key: str) -> str:
        """For an error in the new strategy's options: where its options come from."""
        dropped = f", whose {', '.join(self.dropped)} do not carry over" if self.dropped else ""
        return f"the YAML's strategy is {self.old}{dropped}: give {self.new}'s in the same command, e.g. --set {key}=..."


def swap_strategy(
    raw: Mapping[str, Any], overrides: Sequence[tuple[str, Any]], registered: Mapping[str, type] | None = None
) -> tuple[dict[str, Any], StrategySwap | None]:
    """``raw`` without the YAML's strategy options that do not carry over (:func:`carries_over`)
    when ``overrides`` change ``strategy.name``; options the overrides set are applied after this
    and so always kept. Anything malformed is left for :func:`build_config` to report."""
    section = raw.get("strategy")
    old = section.get("name") if isinstance(section, Mapping) else None
    merged = apply_overrides(raw, overrides)
    new = merged["strategy"].get("name") if isinstance(merged.get("strategy"), Mapping) else None
    registered = strategies() if registered is None else registered
    if old == new or not isinstance(old, str) or not isinstance(new, str) or old not in registered or new not in registered:
        return dict(raw), None
    old_cls, new_cls = registered[old], registered[new]
    key_to_field = {config_key(f): f.name for f in dataclasses.fields(old_cls.Options)}
    kept, dropped = [], []
    for key in section:
        if key in key_to_field:
            (kept if carries_over(key_to_field[key], old_cls, new_cls) else dropped).append(str(key))
    swapped = dict(raw)
    swapped["strategy"] = {key: value for key, value in section.items() if key not in dropped}
    return swapped, StrategySwap(old, new, tuple(kept), tuple(dropped))


def config_to_dict(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as plain YAML-ready data; loading it gives the same config."""
    plain = to_plain(config)
    for section in ("partition", "strategy"):
        options = plain[section].pop("options") or {}
        plain[section].update(options)
    return plain
