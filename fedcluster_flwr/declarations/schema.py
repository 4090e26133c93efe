"""What a valid option is, declared next to its field, and the error that names the key.

Every user-facing option of fedcluster is a field of a frozen dataclass, and what a valid value
is, is declared rather than checked by hand (:mod:`fedcluster_flwr.declarations.options` builds the
dataclasses from the YAML's mappings and runs these declarations):

* the type: ``Literal`` for a choice, ``X | None`` where null is allowed;
* per field, constraints: ``client_fraction: float = option(0.1, Interval(0, 1, closed="right"))``;
  every field also obeys what :func:`~fedcluster_flwr.declarations.options.implied_constraints` adds:
  its numbers finite (no inf, no NaN) unless a constraint of its own admits infinity
  (``Interval(0, math.inf)``), its integers within 64 bits; seeds take :data:`SEED_RANGE`;
* per class, ``rules``: what spans fields (``ExactlyOne("threshold", "num_clusters")``,
  ``OnlyWith``, ``RequiredWith``, ``NoMoreThan``, ``LessThan``), checked when the section is built;
* per class, ``experiment_rules``: the same against the whole experiment config, e.g.
  ``NoMoreThan("num_clusters", "partition.num_clients")``, checked once every section is built.

A check that genuinely needs code stays a ``validate(prefix)`` / ``check_experiment(config,
prefix)`` method; it runs after the declared ones, so it may rely on them. A mistake is a
:class:`ConfigError` that says which dotted key is wrong, what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


def require(condition: bool, key: str, message: str) -> None:
    """Raise a :class:`ConfigError` for ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, message)


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def describe(value: Any) -> str:
    """Short rendering of a user value for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The choice ``name`` most likely meant: one equal but for case (``MNIST``: ``mnist``), else
    the closest spelling compared without case (``Minst``: ``mnist``), else None."""
    by_folded = {choice.casefold(): choice for choice in choices}
    folded = name.casefold()
    if folded in by_folded:
        return by_folded[folded]
    hint = difflib.get_close_matches(folded, list(by_folded), n=1)
    return by_folded[hint[0]] if hint else None


def did_you_mean(name: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a misspelt name, or nothing."""
    hint = closest_name(name, choices) if isinstance(name, str) else None
    return f" (did you mean '{hint}'?)" if hint else ""


def unknown_key_message(name: str, allowed: list[str], context: str = "") -> str:
    suggestion = did_you_mean(name, allowed)
    where = f" {context}" if context else ""
    return f"unknown key{where}{suggestion}; allowed keys: {', '.join(sorted(allowed))}"


def config_key(field: dataclasses.Field) -> str:
    """The YAML key of an options field: its name, or ``metadata["key"]`` where the paper's
    name is a Python keyword (``lambda_ = field(..., metadata={"key": "lambda"})``)."""
    return field.metadata.get("key", field.name)


def config_keys(cls: type) -> list[str]:
    return [config_key(f) for f in dataclasses.fields(cls) if f.init]


def option_key(options: Any, name: str, prefix: str = "") -> str:
    """The dotted key of field ``name`` of ``options`` (its YAML key, under ``prefix``)."""
    field = next(f for f in dataclasses.fields(options) if f.name == name)
    return join_key(prefix, config_key(field))


# ---- declared constraints ----------------------------------------------------------------

CONSTRAINTS = "constraints"  # the field metadata entry option() fills and check_declared reads
NOTE = "note"
ROLES = "roles"  # what the option means to the runner and the apps (fedcluster_flwr.declarations.roles)
REQUIRED: Any = dataclasses.MISSING  # option(REQUIRED, ...): the key has no default


class Constraint(Protocol):
    """What a field's value must satisfy; declared with :func:`option`."""

    def violation(self, value: Any) -> str | None:
        """What is wrong with ``value`` (never None), or None when nothing is."""


def option(default: Any = REQUIRED, *constraints: Constraint, key: str | None = None, note: str | None = None,
           roles: tuple[Any, ...] = (), factory: Any = None) -> Any:
    """A dataclass field whose value must satisfy ``constraints``.

    ``count: int = option(1, at_least(1))`` declares the YAML key ``count`` with default 1, and
    building the dataclass from a mapping fails with ``<prefix>.count: must be >= 1, got 0``.
    A None value is left alone (the ``X | None`` type already says whether null is allowed).
    ``key``: the YAML key where the field's name cannot be it (``lambda``, a Python keyword).
    ``note``: what special values mean, added to every constraint error of the field.
    ``roles``: what else the option is (:mod:`fedcluster_flwr.declarations.roles`: how a run executes,
    fixed on a branch, ...), from which the lists of such keys are derived.
    ``factory``: a default made per instance (a section, a dict), as ``default_factory``.
    """
    metadata: dict[str, Any] = {}
    if constraints:
        metadata[CONSTRAINTS] = constraints
    if key is not None:
        metadata["key"] = key
    if note is not None:
        metadata[NOTE] = note
    if roles:
        metadata[ROLES] = tuple(roles)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Interval:
    """Numbers from ``low`` to ``high``, None leaving that side unbounded; ``closed`` names the
    ends that belong to it: ``Interval(0, 1, closed="right")`` is (0, 1]. NaN is never inside."""

    low: float | None
    high: float | None
    closed: Literal["both", "left", "right", "neither"] = "both"

    def __post_init__(self) -> None:  # declaration mistakes, caught at import
        if self.closed not in ("both", "left", "right", "neither"):
            raise ValueError(f"closed must be both, left, right or neither, got {self.closed!r}")
        if self.low is None and self.high is None:
            raise ValueError("an interval needs at least one bound")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"empty interval: {self.low} > {self.high}")

    @property
    def _left_closed(self) -> bool:
        return self.closed in ("both", "left")

    @property
    def _right_closed(self) -> bool:
        return self.closed in ("both", "right")

    @property
    def admits_infinity(self) -> bool:
        """Whether it was declared to hold inf or -inf (a closed end at ±math.inf): only then does
        an option take them (:class:`Finite`)."""
        return (self.high == math.inf and self._right_closed) or (self.low == -math.inf and self._left_closed)

    def __contains__(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.low is not None and (value < self.low or (value == self.low and not self._left_closed)):
            return False
        return self.high is None or value < self.high or (value == self.high and self._right_closed)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>=' if self._left_closed else '>'} {_number(self.low)}"
        if self.low is None:
            return f"{'<=' if self._right_closed else '<'} {_number(self.high)}"
        left, right = "[" if self._left_closed else "(", "]" if self._right_closed else ")"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"

    def violation(self, value: float) -> str | None:
        return None if value in self else f"must be {self}, got {describe(value)}"


def at_least(low: float) -> Interval:
    """``low`` or more: [low, inf)."""
    return Interval(low, None, closed="left")


def above(low: float) -> Interval:
    """More than ``low``: (low, inf)."""
    return Interval(low, None, closed="neither")


def _number(bound: float) -> str:
    """A bound as a user writes it: ``0.5``, ``1e-06``, and an integer in full (``4294967295``)."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


# Seeds reach torch.manual_seed, numpy's generators and scikit-learn's random_state (FL+HC's random
# projection), and the last takes 0 to 2**32 - 1.
SEED_RANGE = Interval(0, 2**32 - 1)


@dataclass(frozen=True, eq=False)
class InRegistry:
    """A name among the keys of ``registry``; ``what`` names the kind (``unknown model 'x'``) and
    ``retired`` maps former names to what became of them."""

    registry: Mapping[str, Any]
    what: str
    retired: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def violation(self, value: Any) -> str | None:
        if isinstance(value, str) and value in self.retired:
            return f"'{value}' {self.retired[value]}"
        if isinstance(value, str) and value in self.registry:
            return None
        return f"unknown {self.what} {describe(value)}{did_you_mean(value, self.registry)}; available: {', '.join(self.registry)}"


@dataclass(frozen=True)
class HostPort:
    """A network address ``HOST:PORT`` (``[::1]:6379`` for an IPv6 host), port 1-65535, no scheme;
    ``example`` shows the form in the error."""

    example: str

    def violation(self, value: Any) -> str | None:
        host, _, port = str(value).rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if host and "/" not in host and not any(c.isspace() for c in host) and port.isdigit() and 1 <= int(port) <= 65535:
            return None
        return f"expected HOST:PORT such as {self.example}, got {describe(value)}"


def as_yaml(value: Any) -> str:
    """A value as it is written in YAML (``true``, ``null``, ``random_projection``), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# Conditions on one field of an options instance, for the rules below.


class Condition(Protocol):
    name: str  # the field it looks at

    def holds(self, options: Any) -> bool: ...

    def text(self, options: Any) -> str:
        """The condition as a user reads it: ``features random_projection``."""


@dataclass(frozen=True, init=False)
class Is:
    """Field ``name`` holds one of ``values``: ``Is("features", "random_projection")``."""

    name: str
    values: tuple[Any, ...]

    def __init__(self, name: str, *values: Any) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "values", values)

    def holds(self, options: Any) -> bool:
        return getattr(options, self.name) in self.values

    def text(self, options: Any) -> str:
        return f"{option_key(options, self.name)} {' or '.join(map(as_yaml, self.values))}"


class IsNot(Is):
    """Field ``name`` holds none of ``values``: ``IsNot("two_hop_estimate", "paper")``."""

    def holds(self, options: Any) -> bool:
        return not super().holds(options)

    def text(self, options: Any) -> str:
        return f"{option_key(options, self.name)} other than {' or '.join(map(as_yaml, self.values))}"


@dataclass(frozen=True)
class Given:
    """Field ``name`` is given: not None."""

    name: str

    def holds(self, options: Any) -> bool:
        return getattr(options, self.name) is not None

    def text(self, options: Any) -> str:
        return option_key(options, self.name)


# Rules: class-level declarations of what spans fields. Each names fields by their Python names
# and raises a ConfigError on the dotted key of the field at fault. ``message``, where a rule
# takes one, replaces the generated text: a str.format template over the options' fields (and
# ``bound`` for the comparisons), for wording that explains why.


class Rule(Protocol):
    def check(self, options: Any, prefix: str, context: Any) -> None:
        """Raise a ConfigError unless ``options`` (the section under ``prefix``) satisfies the rule.
        ``context`` is what dotted bounds are read from: the options themselves in ``rules``, the
        experiment config in ``experiment_rules``."""


def _fill(template: str, options: Any, **extra: Any) -> str:
    return template.format(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}, **extra)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


@dataclass(frozen=True, init=False)
class ExactlyOne:
    """Exactly one of the fields ``names`` is given (not None); the error names the first."""

    names: tuple[str, ...]
    allows_none = False

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", names)

    def check(self, options: Any, prefix: str, context: Any) -> None:
        given = [n for n in self.names if getattr(options, n) is not None]
        if len(given) == 1 or (self.allows_none and not given):
            return
        if not given:
            got = "neither" if len(self.names) == 2 else "none"
        else:
            got = _and([f"{option_key(options, n)} {describe(getattr(options, n))}" for n in given])
        keys = [option_key(options, n, prefix) for n in self.names]
        raise ConfigError(keys[0], f"give {'at most' if self.allows_none else 'exactly'} one of {_and(keys)}; got {got}")


class AtMostOne(ExactlyOne):
    """At most one of the fields ``names`` is given (not None); the error names the first."""

    allows_none = True


@dataclass(frozen=True)
class OnlyWith:
    """``subject`` may hold only together with ``condition``. ``subject`` is a field name (the field
    is given) or a :class:`Condition` (``Is("linkage", "ward")``); the error names its field."""

    subject: str | Condition
    condition: Condition
    message: str | None = None

    def check(self, options: Any, prefix: str, context: Any) -> None:
        subject = Given(self.subject) if isinstance(self.subject, str) else self.subject
        if not subject.holds(options) or self.condition.holds(options):
            return
        actual = f"{option_key(options, self.condition.name)} is {as_yaml(getattr(options, self.condition.name))}"
        generated = f"only {self.condition.text(options)} takes {subject.text(options)} ({actual})"
        message = _fill(self.message, options) if self.message else generated
        raise ConfigError(option_key(options, subject.name, prefix), message)


@dataclass(frozen=True)
class RequiredWith:
    """Field ``name`` must be given (not None) when ``condition`` holds."""

    name: str
    condition: Condition
    message: str | None = None

    def check(self, options: Any, prefix: str, context: Any) -> None:
        if getattr(options, self.name) is not None or not self.condition.holds(options):
            return
        generated = f"{self.condition.text(options)} needs {option_key(options, self.name)}"
        raise ConfigError(option_key(options, self.name, prefix), _fill(self.message, options) if self.message else generated)


def lookup(source: Any, dotted: str) -> Any:
    """The value at dotted key ``dotted`` of a config object: ``partition.num_clients``."""
    for part in dotted.split("."):
        source = getattr(source, part)
    return source


@dataclass(frozen=True)
class _Comparison:
    """Field ``name``, where given, compared with the value at ``bound``: another field of the
    options (in ``rules``) or a dotted key of the experiment config (``partition.num_clients``, in
    ``experiment_rules``). ``why`` is added to the generated message."""

    name: str
    bound: str
    why: str | None = None
    message: str | None = None
    expectation: ClassVar[str]

    def allows(self, value: Any, bound: Any) -> bool:
        raise NotImplementedError

    def check(self, options: Any, prefix: str, context: Any) -> None:
        value, bound = getattr(options, self.name), lookup(context, self.bound)
        if value is None or self.allows(value, bound):
            return
        if self.message:
            message = _fill(self.message, options, bound=bound)
        else:
            why = f": {self.why}" if self.why else ""
            message = f"{self.expectation} {self.bound} ({bound}){why}; got {describe(value)}"
        raise ConfigError(option_key(options, self.name, prefix), message)


class NoMoreThan(_Comparison):
    """Field ``name`` is at most the value at ``bound``: ``NoMoreThan("num_kept", "num_neighbours")``."""

    expectation = "cannot exceed"

    def allows(self, value: Any, bound: Any) -> bool:
        return value <= bound


class LessThan(_Comparison):
    """Field ``name`` is below the value at ``bound``: ``LessThan("warmup_rounds", "rounds")``."""

    expectation = "must be below"

    def allows(self, value: Any, bound: Any) -> bool:
        return value < bound


def declared_rules(cls: type, attribute: str) -> list[Rule]:
    """The rules ``cls`` and its bases declare in class attribute ``attribute``, bases first: a
    subclass's options obey its parents' rules too."""
    return [rule for klass in reversed(cls.__mro__) for rule in vars(klass).get(attribute, ())]
