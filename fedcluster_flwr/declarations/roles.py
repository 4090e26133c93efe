"""What an option is, besides its value: declared with it, and every list of such keys derived.

An option declares its roles where it is declared (``option(..., roles=(EXECUTION,))``, see
:func:`fedcluster_flwr.declarations.schema.option`); the runner, the apps and the CLI read the lists derived here
from the declarations, never a list kept by hand, so a new option is in every list its roles put it
in and in no other:

* :data:`EXECUTION`: says how the rounds execute or are logged, not what they compute (the engine,
  Ray's resources, the tracker). It may differ when a run resumes in place (``fedcluster resume
  RUN_DIR --set``) and between a stopped comparison and its continuation.
* :data:`FIXED_ON_BRANCH`: produced the checkpoint (the data, the clients, the model, the seed, the
  strategy): a branch of the checkpoint cannot change it.
* :func:`no_effect_under_flwr_run`: under ``flwr run`` the SuperLink's own runtime runs the
  clients, so the option does nothing there; the reason says what to use instead.
* :data:`RUN_CONFIG`: a key of its own in ``flwr run --run-config`` (pyproject.toml's
  ``[tool.flwr.app.config]``, checked against this list by a test); every other key goes through
  ``set``.
* :data:`SAME_MEANING`: a strategy option that means the same in every strategy declaring it (the
  share of clients per round, the number of clusters), so it is kept when an override changes
  ``strategy.name``, and has a run-config key ``strategy.<name>``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .schema import ROLES, config_key, join_key


@dataclass(frozen=True)
class Role:
    """A role an option declares; ``reason`` says why it has it where a message needs to."""

    name: str
    reason: str = ""

    def declared_by(self, field: dataclasses.Field) -> Role | None:
        """This role as ``field`` declares it (with its reason), or None."""
        return next((role for role in field.metadata.get(ROLES, ()) if role.name == self.name), None)


EXECUTION = Role("execution")
FIXED_ON_BRANCH = Role("fixed on a branch")
RUN_CONFIG = Role("run-config key")
SAME_MEANING = Role("same meaning in every strategy")
NO_EFFECT_UNDER_FLWR_RUN = Role("no effect under flwr run")


# What each role says of a key in the generated config reference (docs/reference/config.md).
ROLE_TEXT = {
    EXECUTION.name: "may change when the run resumes in place: how the rounds execute, not what they compute",
    FIXED_ON_BRANCH.name: "fixed on a branch (it produced the checkpoint)",
    RUN_CONFIG.name: "a key of its own in flwr run --run-config",
    SAME_MEANING.name: "means the same in every strategy: kept when an override changes strategy.name",
    NO_EFFECT_UNDER_FLWR_RUN.name: "no effect under flwr run",
}


def roles_text(field: dataclasses.Field) -> str:
    """The roles ``field`` declares, as the config reference states them (with their reasons)."""
    return "; ".join(ROLE_TEXT[role.name] + (f" ({role.reason})" if role.reason else "")
                     for role in field.metadata.get(ROLES, ()))


def no_effect_under_flwr_run(reason: str) -> Role:
    """The role of an option ``flwr run`` cannot honour; ``reason`` says what to use instead."""
    return Role(NO_EFFECT_UNDER_FLWR_RUN.name, reason)


def _sections(cls: type) -> dict[str, Any]:
    """``cls``'s field types, resolved (the modules use ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def declared(cls: type, role: Role, prefix: str = "") -> dict[str, Role]:
    """Dotted key -> the role as declared, for every field of ``cls`` and of its sections (fields
    whose type is itself a dataclass), depth first in declaration order, that declares ``role``."""
    found: dict[str, Role] = {}
    types = _sections(cls)
    for field in dataclasses.fields(cls):
        key = join_key(prefix, config_key(field))
        if (as_declared := role.declared_by(field)) is not None:
            found[key] = as_declared
        section = types.get(field.name)
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            found |= declared(section, role, key)
    return found


def keys_with(cls: type, role: Role) -> tuple[str, ...]:
    """The dotted keys of ``cls`` (an experiment config class) that declare ``role``, in order."""
    return tuple(declared(cls, role))


def default_of(cls: type, dotted: str) -> Any:
    """The declared default of dotted key ``dotted`` of ``cls`` (a section's default made anew)."""
    section, _, rest = dotted.partition(".")
    field = next(f for f in dataclasses.fields(cls) if config_key(f) == section)
    if rest:
        return default_of(_sections(cls)[field.name], rest)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _with_options(strategy_classes: Iterable[type]) -> list[type]:
    """The classes among ``strategy_classes`` that declare an ``Options`` dataclass."""
    return [cls for cls in strategy_classes if dataclasses.is_dataclass(getattr(cls, "Options", None))]


def same_meaning_options(strategy_classes: Iterable[type]) -> tuple[str, ...]:
    """The option names (fields) that some of ``strategy_classes``' ``Options`` declare with
    :data:`SAME_MEANING`, sorted. Every strategy declaring a field of such a name must declare it so
    (:func:`check_same_meaning`)."""
    return tuple(sorted({field.name for cls in _with_options(strategy_classes)
                         for field in dataclasses.fields(cls.Options) if SAME_MEANING.declared_by(field)}))


def run_config_keys(cls: type, strategy_classes: Iterable[type]) -> tuple[str, ...]:
    """The keys of their own ``flwr run --run-config`` takes besides ``config`` and ``set``: those
    declared :data:`RUN_CONFIG`, and ``strategy.<name>`` of every same-meaning strategy option (it
    means the same whichever strategy the run names)."""
    return keys_with(cls, RUN_CONFIG) + tuple(f"strategy.{name}" for name in same_meaning_options(strategy_classes))


def check_same_meaning(strategy_classes: Iterable[type]) -> None:
    """Refuse a strategy whose option has the name of a same-meaning option without declaring it so
    (it would be carried into another strategy meaning something else): a programming error."""
    classes = _with_options(strategy_classes)
    names = set(same_meaning_options(classes))
    for cls in classes:
        for field in dataclasses.fields(cls.Options):
            if field.name in names and not SAME_MEANING.declared_by(field):
                raise TypeError(f"{cls.__name__}.Options.{field.name}: other strategies declare {field.name} with "
                                "roles=(SAME_MEANING,) (it means the same in every strategy); declare it so, or rename it")
