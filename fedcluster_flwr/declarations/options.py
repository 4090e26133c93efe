"""Build frozen options dataclasses from plain mappings, with errors that name the key.

This turns the nested dicts read from YAML (plus overrides) into the dataclasses whose fields
declare what a valid value is (:mod:`fedcluster_flwr.declarations.schema`): it checks keys and value types,
then runs the declarations, and reports the first problem as a :class:`ConfigError` that says
which dotted key is wrong, what was expected and what was given. Every option also obeys
:func:`implied_constraints`: finite numbers and 64-bit integers. :func:`to_plain` goes back.

An options dataclass that derives from :class:`DeclaredOptions` is checked against the same
declarations whenever it is made, also in code (``FractionOptions(0.25)`` handed to a strategy):
its errors then name the field (``client_fraction: must be in (0, 1], got 1.5``); built by
:func:`from_mapping`, the dotted key under the section (``strategy.client_fraction``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

from .schema import (
    CONSTRAINTS,
    NOTE,
    ConfigError,
    Constraint,
    config_key,
    declared_rules,
    describe,
    join_key,
    unknown_key_message,
)

T = TypeVar("T")


def from_mapping(
    cls: type[T], data: Mapping[str, Any] | None, prefix: str = "", *, built: Mapping[str, Any] | None = None
) -> T:
    """Build dataclass ``cls`` from ``data``, checking keys, value types and declared constraints.

    Missing keys take the field's default; unknown keys, wrong types and values outside a
    ``Literal`` are errors. ``built`` holds fields the caller built itself (a section's own
    options dataclass), taken as they are. The built instance is then checked by
    :func:`check_declared` under ``prefix`` (a :class:`DeclaredOptions` checks itself as it is
    made, under the same prefix).
    """
    data = {} if data is None else data
    built = {} if built is None else built
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping of keys, got {describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(join_key(prefix, str(key)), unknown_key_message(str(key), list(fields)))
    values: dict[str, Any] = {}
    for name, field in fields.items():
        key = join_key(prefix, name)
        if field.name in built:
            values[field.name] = built[field.name]
        elif name in data:
            values[field.name] = coerce(data[name], hints[field.name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "is required")
    building = _BUILT_UNDER.set(prefix)
    try:
        instance = cls(**values)
    finally:
        _BUILT_UNDER.reset(building)
    check_declared(instance, prefix)  # a DeclaredOptions' declarations again (cheap), then its validate
    return instance


# The section an instance is being built under by from_mapping (its errors name the dotted key);
# "" for an instance made in code. A context variable, so that threads building configs at once
# (a batched run's clients) each keep their own.
_BUILT_UNDER: contextvars.ContextVar[str] = contextvars.ContextVar("built_under", default="")


class DeclaredOptions:
    """Base of an options dataclass: every instance, however it is made, is checked against its
    declarations (:func:`check_declared`: choices, constraints, rules) when it is made, so that an
    options object built in code obeys the constraints a config's does. Its ``validate`` method,
    which may read a file or import an optional package, runs where a config is built
    (:func:`from_mapping`). A subclass with a ``__post_init__`` of its own calls this one."""

    def __post_init__(self) -> None:
        check_declared(self, _BUILT_UNDER.get(), validate=False)


DERIVED = "derived"  # field metadata: worked out from the config's keys, not one of them


def derived(default: Any = None) -> Any:
    """A field that is no key of the config but what its keys resolve to (the strategy class that
    ``strategy.name`` selects, found once when the config is read): never written out
    (:func:`to_plain`), never compared, carried with the config to every process it goes to."""
    return dataclasses.field(default=default, compare=False, repr=False, metadata={DERIVED: True})


def to_plain(value: Any) -> Any:
    """Dataclasses and tuples to dicts and lists, for YAML/JSON output (without :func:`derived` fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {config_key(f): to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get(DERIVED)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(hint))
    if origin in (tuple, list):
        args = typing.get_args(hint)
        return f"a list of {type_name(args[0])}" if args else "a list"
    if origin is dict:
        k, v = typing.get_args(hint)
        return f"a mapping of {type_name(k)} to {type_name(v)}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against type ``hint``; lists become tuples (hashable configs)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected {type_name(hint)}, got {describe(value)}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(
                key, f"expected one of {', '.join(map(str, choices))}; got {describe(value)}"
            )
        return value
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected {type_name(hint)}, got {describe(value)}")
        return tuple(coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected {type_name(hint)}, got {describe(value)}")
        return {
            coerce(k, key_type, f"{key}.{k}"): coerce(v, value_type, f"{key}.{k}")
            for k, v in value.items()
        }
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {describe(value)}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, key)
    raise TypeError(f"unsupported config type {hint!r} for {key}")  # programming error


# What every option obeys beside its declarations: run by check_declared, never declared per field.

INT64 = (-(2**63), 2**63 - 1)


def _numbers(value: Any, where: str = "") -> Iterable[tuple[str, Any]]:
    """Every number in an option's value (lists and mappings, keys included, looked into), with
    where it is (``""``, ``"[1]"``, ``".3"``), for the implied constraints."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield where, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{where}[{i}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _numbers(key, f"{where} (key {describe(key)})")
            yield from _numbers(item, f"{where}.{key}")


def _in(where: str) -> str:
    return f" at {where.lstrip('.')}" if where else ""


@dataclass(frozen=True)
class Finite:
    """No inf and no NaN among the option's numbers: an update, a loss or a learning rate of inf
    makes every later number NaN, and the run "finishes" having learnt nothing."""

    def violation(self, value: Any) -> str | None:
        bad = next(((w, v) for w, v in _numbers(value) if isinstance(v, float) and not math.isfinite(v)), None)
        return None if bad is None else f"must be a finite number, got {describe(bad[1])}{_in(bad[0])}"


@dataclass(frozen=True)
class FitsInt64:
    """Every integer of the option within 64 bits: torch, numpy and Flower's messages hold no more."""

    def violation(self, value: Any) -> str | None:
        bad = next(((w, v) for w, v in _numbers(value) if isinstance(v, int) and not INT64[0] <= v <= INT64[1]), None)
        return None if bad is None else f"must fit in 64 bits (at most 2**63 - 1), got {describe(bad[1])}{_in(bad[0])}"


def implied_constraints(declared: Iterable[Constraint]) -> tuple[Constraint, ...]:
    """What every option obeys besides its ``declared`` constraints (checked after them, whose
    messages are the more precise): finite numbers, unless one of ``declared`` admits infinity,
    and 64-bit integers."""
    admits_infinity = any(getattr(c, "admits_infinity", False) for c in declared)
    return (FitsInt64(),) if admits_infinity else (Finite(), FitsInt64())


@functools.cache
def _choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The fields of ``cls`` typed ``Literal[...]`` (or ``Literal[...] | None``) and their choices."""
    found = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
        literal = [choice for arg in args if typing.get_origin(arg) is Literal for choice in typing.get_args(arg)]
        if literal:
            found[name] = tuple(literal)
    return found


def check_declared(options: Any, prefix: str = "", *, validate: bool = True) -> None:
    """Check a built options dataclass against its declarations, in this order: each field's
    ``Literal`` choices and constraints (field order; its declared ones, then those every field
    obeys: :func:`implied_constraints`), the class's ``rules``, then (``validate``) its
    ``validate(prefix)`` method if any."""
    choices = _choices(type(options))
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if value is None:
            continue
        if field.name in choices and value not in choices[field.name]:  # what coerce says of a YAML value
            raise ConfigError(join_key(prefix, config_key(field)),
                              f"expected one of {', '.join(map(str, choices[field.name]))}; got {describe(value)}")
        declared = field.metadata.get(CONSTRAINTS, ())
        for constraint in (*declared, *implied_constraints(declared)):
            problem = constraint.violation(value)
            if problem is not None:
                note = field.metadata.get(NOTE)
                raise ConfigError(join_key(prefix, config_key(field)), f"{problem} ({note})" if note else problem)
    for rule in declared_rules(type(options), "rules"):
        rule.check(options, prefix, options)
    method = getattr(options, "validate", None)
    if validate and callable(method):
        method(prefix)


def check_in_experiment(options: Any, config: Any, prefix: str) -> None:
    """Check the options of section ``prefix`` against the whole experiment ``config``: the class's
    ``experiment_rules``, then its ``check_experiment(config, prefix)`` method if any."""
    for rule in declared_rules(type(options), "experiment_rules"):
        rule.check(options, prefix, config)
    check = getattr(options, "check_experiment", None)
    if callable(check):
        check(config, prefix)
