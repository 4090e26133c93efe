"""Bad input generated from the declarations (Hypothesis): every declared option of every config
section, partitioner and registered strategy, found by walking the declarations themselves, so a
new option is covered without editing this file.

An option is *declared* where its field has constraints (``option(default, Interval(...))``,
``InRegistry``, ``HostPort``) or a ``Literal`` type. For each, values drawn to break the
declaration must be refused in one ``ConfigError`` line naming the dotted key (as a config) or the
field (as an options object made in code, :class:`DeclaredOptions`); values drawn to satisfy it,
and every closed bound itself, must be accepted; an open bound itself is refused. The draws are
bounded and derandomized: the same examples on every run.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcluster_flwr.config.load import build_config, load_config
from fedcluster_flwr.config.sections import (
    ClientConfig,
    DatasetConfig,
    ExperimentConfig,
    FaultsConfig,
    ModelConfig,
    PartitionConfig,
    SimulationConfig,
)
from fedcluster_flwr.data.partitions import PARTITIONERS
from fedcluster_flwr.declarations.options import INT64, DeclaredOptions, coerce
from fedcluster_flwr.registry import strategies
from fedcluster_flwr.declarations.schema import (
    CONSTRAINTS,
    ConfigError,
    HostPort,
    InRegistry,
    Interval,
    Is,
    IsNot,
    OnlyWith,
    RequiredWith,
    config_key,
    declared_rules,
    join_key,
)

MODEL = {"name": "mlp_digits"}  # the one key a config must give
SECTIONS = {"dataset": DatasetConfig, "model": ModelConfig, "client": ClientConfig, "simulation": SimulationConfig,
            "faults": FaultsConfig}
DRAWS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@dataclass(frozen=True)
class Declared:
    """One declared option: its field of options class ``cls``, under ``section`` ("" at the top
    level), in the entry ``owner`` of the partition or strategy registry (None elsewhere)."""

    section: str
    cls: type
    field: dataclasses.Field
    owner: str | None = None

    @property
    def key(self) -> str:
        return config_key(self.field)

    @property
    def dotted(self) -> str:
        return join_key(self.section, self.key)

    @property
    def id(self) -> str:
        return self.dotted if self.owner is None else f"{self.dotted}@{self.owner}"

    @property
    def hint(self) -> Any:
        return typing.get_type_hints(self.cls)[self.field.name]

    @property
    def constraints(self) -> tuple[Any, ...]:
        return self.field.metadata.get(CONSTRAINTS, ())

    @property
    def choices(self) -> tuple[Any, ...]:
        return literal_choices(self.hint)

    @property
    def number_type(self) -> type | None:
        """int or float where the option is a number (or null), else None."""
        return next((t for t in (int, float) if t in (self.hint, *typing.get_args(self.hint))), None)


def literal_choices(hint: Any) -> tuple[Any, ...]:
    args = typing.get_args(hint) if typing.get_origin(hint) is not Literal else (hint,)
    return tuple(c for arg in args if typing.get_origin(arg) is Literal for c in typing.get_args(arg))


def declared_options() -> list[Declared]:
    """Every declared option, from the declarations: the experiment's sections and top-level keys,
    the partition section's own keys and every partitioner's options, every strategy's options."""
    owners: list[tuple[str, type, str | None]] = [(name, cls, None) for name, cls in SECTIONS.items()]
    owners += [("", ExperimentConfig, None), ("partition", PartitionConfig, None)]
    owners += [("partition", entry.options, name) for name, entry in PARTITIONERS.items()]
    owners += [("strategy", cls.Options, name) for name, cls in strategies().items()]
    found = []
    for section, cls, owner in owners:
        for field in dataclasses.fields(cls):
            case = Declared(section, cls, field, owner)
            if field.init and (case.constraints or case.choices):
                found.append(case)
    return found


CASES = declared_options()


# ---- what the declarations say is valid, or not ----------------------------------------------------


def interval_of(case: Declared) -> Interval | None:
    return next((c for c in case.constraints if isinstance(c, Interval)), None)


def closed_bounds(interval: Interval) -> list[float]:
    ends = [(interval.low, interval.closed in ("both", "left")), (interval.high, interval.closed in ("both", "right"))]
    return [bound for bound, closed in ends if bound is not None and closed and math.isfinite(bound)]


def open_bounds(interval: Interval) -> list[float]:
    ends = [(interval.low, interval.closed in ("both", "left")), (interval.high, interval.closed in ("both", "right"))]
    return [bound for bound, closed in ends if bound is not None and not closed]


def numbers_inside(interval: Interval, kind: type) -> st.SearchStrategy:
    left, right = interval.closed in ("both", "left"), interval.closed in ("both", "right")
    if kind is int:
        low = INT64[0] if interval.low is None else math.ceil(interval.low) + (0 if left else 1)
        high = INT64[1] if interval.high is None else min(math.floor(interval.high) - (0 if right else 1), INT64[1])
        return st.integers(low, high)
    return st.floats(interval.low, interval.high, exclude_min=not left and interval.low is not None,
                     exclude_max=not right and interval.high is not None, allow_nan=False,
                     allow_infinity=interval.admits_infinity)


def numbers_outside(interval: Interval, kind: type) -> st.SearchStrategy:
    left, right = interval.closed in ("both", "left"), interval.closed in ("both", "right")
    sides = []
    if kind is int:  # within 64 bits: the interval's message, not the implied one's
        if interval.low is not None:
            sides.append(st.integers(INT64[0], math.ceil(interval.low) - (1 if left else 0)))
        if interval.high is not None and interval.high < INT64[1]:
            sides.append(st.integers(math.floor(interval.high) + (1 if right else 0), INT64[1]))
        return st.one_of(sides)
    if interval.low is not None:
        sides.append(st.floats(max_value=interval.low, exclude_max=left, allow_nan=False))
    if interval.high is not None:
        sides.append(st.floats(min_value=interval.high, exclude_min=right, allow_nan=False))
    return st.one_of(*sides, st.just(math.nan))


def hosts() -> st.SearchStrategy:
    return st.from_regex(r"[a-z][a-z0-9-]{0,15}(\.[a-z0-9-]{1,10}){0,2}", fullmatch=True) | st.just("[::1]")


def valid_values(case: Declared) -> st.SearchStrategy:
    if case.choices:
        return st.sampled_from(case.choices)
    constraint = case.constraints[0]
    if isinstance(constraint, Interval):
        return numbers_inside(constraint, case.number_type)
    if isinstance(constraint, InRegistry):
        return st.sampled_from(sorted(constraint.registry))
    if isinstance(constraint, HostPort):
        return st.builds(lambda host, port: f"{host}:{port}", hosts(), st.integers(1, 65535))
    raise AssertionError(f"{case.id}: no valid values drawn for {constraint!r}: add them here")


def invalid_values(case: Declared) -> st.SearchStrategy:
    if case.choices:
        return st.text(max_size=12).filter(lambda text: text not in case.choices)
    constraint = case.constraints[0]
    if isinstance(constraint, Interval):
        return numbers_outside(constraint, case.number_type)
    if isinstance(constraint, InRegistry):
        known = {*constraint.registry, *constraint.retired}
        return st.text(max_size=12).filter(lambda text: text not in known)
    if isinstance(constraint, HostPort):
        ports = st.integers(INT64[0], 0) | st.integers(65536, INT64[1])
        return (st.builds(lambda host, port: f"{host}:{port}", hosts(), ports)
                | st.builds(lambda host: f"http://{host}:8265", hosts()) | hosts())
    raise AssertionError(f"{case.id}: no invalid values drawn for {constraint!r}: add them here")


# ---- one option set, as a config and in code ---------------------------------------------------------


def needed_beside(case: Declared, value: Any) -> dict[str, Any]:
    """Values of the options class's other fields that its rules ask for where ``case`` holds
    ``value`` (``simulation.batched_workers`` needs ``engine: batched``), by field name."""
    holding = SimpleNamespace(**{case.field.name: value})  # what a rule's condition reads of the option
    needed: dict[str, Any] = {}
    for rule in declared_rules(case.cls, "rules"):
        if isinstance(rule, OnlyWith):
            subject = rule.subject if isinstance(rule.subject, str) else rule.subject.name
            if subject != case.field.name or (not isinstance(rule.subject, str) and not rule.subject.holds(holding)):
                continue
            condition = rule.condition
            if isinstance(condition, IsNot):
                field = next(f for f in dataclasses.fields(case.cls) if f.name == condition.name)
                others = Declared(case.section, case.cls, field).choices
                needed[condition.name] = next(c for c in others if c not in condition.values)
            elif isinstance(condition, Is):
                needed[condition.name] = condition.values[0]
        elif isinstance(rule, RequiredWith) and rule.condition.name == case.field.name and rule.condition.holds(holding):
            needed[rule.name] = _some_value_of(case.cls, rule.name)
    return needed


def _some_value_of(cls: type, name: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    interval = interval_of(Declared("", cls, field))
    if interval is not None:
        return next(iter(closed_bounds(interval)), 1)
    return "data"


def as_config(case: Declared, value: Any) -> dict[str, Any]:
    """A config (YAML's mapping) that sets the option to ``value`` and nothing else but what a
    config needs and the option's rules ask for."""
    keys = {case.key: value} | {config_key(f): v for f in dataclasses.fields(case.cls)
                                for n, v in needed_beside(case, value).items() if f.name == n}
    if case.section == "":
        return {"model": MODEL, **keys}
    if case.section in ("partition", "strategy"):
        name = case.owner or "iid"
        return {"model": MODEL, case.section: {"name": name, **keys}}
    return ({} if case.section == "model" else {"model": MODEL}) | {case.section: keys}


@functools.cache
def default_config() -> ExperimentConfig:
    return load_config(None, [("model.name", MODEL["name"])])[0]


def made_in_code(case: Declared, value: Any) -> Any:
    """The options object with the option set to ``value``, made in code (no config involved)."""
    fields = {case.field.name: value, **needed_beside(case, value)}
    if case.cls is ExperimentConfig:
        return dataclasses.replace(default_config(), **fields)
    if case.cls is PartitionConfig:
        return PartitionConfig(name="iid", options=PARTITIONERS["iid"].options(), **fields)
    return case.cls(**fields)


def assert_one_line_naming(err: ConfigError, key: str) -> None:
    assert err.key == key and str(err).startswith(f"{key}: "), str(err)
    assert "\n" not in str(err)


# ---- the tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@DRAWS
@given(data=st.data())
def test_a_value_breaking_a_declaration_is_one_error_naming_the_key(case, data):
    """Refused as a config (the dotted key) and as an options object made in code (the field's key);
    an interval's open bounds are drawn first, then values outside it and NaN."""
    interval = interval_of(case)
    bounds = [case.number_type(b) for b in open_bounds(interval)] if interval and case.number_type else []
    for value in (*bounds, data.draw(invalid_values(case), label="value")):
        with pytest.raises(ConfigError) as as_config_error:
            build_config(as_config(case, value))
        assert_one_line_naming(as_config_error.value, case.dotted)
        with pytest.raises(ConfigError) as in_code_error:
            made_in_code(case, value)
        assert_one_line_naming(in_code_error.value, case.key)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@DRAWS
@given(data=st.data())
def test_a_value_within_a_declaration_is_accepted_and_so_is_each_closed_bound(case, data):
    """As a config's value (read as YAML gives it, then the declarations) and made in code. A check
    that needs code (``validate``: files, other options) is not the declaration's and not run here."""
    interval = interval_of(case)
    bounds = [case.number_type(b) for b in closed_bounds(interval)] if interval and case.number_type else []
    for value in (*bounds, data.draw(valid_values(case), label="value")):
        read = coerce(value, case.hint, case.dotted)
        assert getattr(made_in_code(case, read), case.field.name) == read


def test_the_declarations_cover_every_section_partitioner_and_strategy():
    """The number of declared options covered is filled in below from the declarations."""
    sections = {case.section for case in CASES}
    owners = {case.owner for case in CASES if case.section == "strategy"}
    assert sections == {"", "dataset", "model", "client", "simulation", "faults", "partition", "strategy"}
    assert owners == {name for name, cls in strategies().items() if dataclasses.fields(cls.Options)}
    assert len(CASES) >= 120  # 127 when this test was written; a new option only adds to it


test_the_declarations_cover_every_section_partitioner_and_strategy.__doc__ = (
    f"{len(CASES)} declared options ({len({c.dotted for c in CASES})} distinct dotted keys, "
    f"{len({c.owner for c in CASES if c.section == 'strategy'})} strategies) are drawn for: every section, "
    "partitioner and strategy is among them."
)


def test_every_options_dataclass_of_the_declarations_checks_itself_when_made():
    """So that ``FractionOptions(1.5)`` handed to a strategy in code is refused as the config would be."""
    classes = {case.cls for case in CASES} | {entry.options for entry in PARTITIONERS.values()}
    classes |= {cls.Options for cls in strategies().values()}
    plain = sorted(cls.__qualname__ for cls in classes if not issubclass(cls, DeclaredOptions))
    assert not plain, f"options dataclasses that do not derive from DeclaredOptions: {plain}"
