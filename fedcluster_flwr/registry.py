"""The algorithm registry: which strategy a ``strategy.name`` selects, which handler a client runs
for a task. Nothing here lists a method: each family registers itself when it is imported.

* A strategy class registers with :func:`register` (its ``name`` is what ``strategy.name`` says).
* A client task's handler registers with :func:`handles` (``@handles(SOME_TASK)``).
* A local objective registers with :func:`objective` (``@objective("proximal", config=("mu",))``):
  the ``train`` task's ``objective`` names it, and the client builds it from the instruction's
  scalars (:class:`fedcluster_flwr.training.Objective`: the terms every engine adds to the loss).

:func:`load_families` imports every family once, on first need (a config naming a strategy, a
client receiving a task it has no handler for):

1. every subpackage of :mod:`fedcluster_flwr.algorithms` (the families shipped here);
2. every entry point of the group ``fedcluster_flwr.algorithms`` (an installed package's
   ``[project.entry-points."fedcluster_flwr.algorithms"] toy = "toy_family"``);
3. every module named in the environment variable ``FEDCLUSTER_ALGORITHMS`` (comma-separated
   import names, for a family that is importable but not installed). The Ray workers of a Ray that
   the run starts itself inherit it; the nodes of a Ray cluster joined with ``simulation.ray_address``
   and SuperNodes on other machines do not: install the family there, with its entry point.

Families are found by name, never imported from here by a static import, so that this module
sits below everything that uses it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .declarations.roles import check_same_meaning
from .declarations.schema import ConfigError

if TYPE_CHECKING:
    from .protocol import Task

ENTRY_POINT_GROUP = "fedcluster_flwr.algorithms"
FAMILIES_VARIABLE = "FEDCLUSTER_ALGORITHMS"
BUILT_IN = "fedcluster_flwr.algorithms"
SHARED_PACKAGES = ("base",)  # subpackages of BUILT_IN that are code the families share, not a family

Handler = Callable[..., Any]  # (client.ClusterClient, client.TaskInput) -> client.TaskOutput

ObjectiveBuilder = Callable[..., Any]  # (instruction config) -> training.Objective

STRATEGIES: dict[str, type] = {}  # strategy name -> strategy class
HANDLERS: dict[str, tuple[Task, Handler]] = {}  # task name -> (task, its handler)
OBJECTIVES: dict[str, tuple[tuple[str, ...], ObjectiveBuilder]] = {}  # objective name -> (its config keys, builder)
_loaded: set[str] = set()  # the family modules imported so far
_scanned = False  # whether the shipped families and the entry points were loaded
_lock = threading.RLock()  # a batched run's client threads may load the families for a task at once


class FamilyImportError(ConfigError):
    """A family named by an entry point or ``FEDCLUSTER_ALGORITHMS`` could not be imported."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)


def register(cls: type) -> type:
    """Class decorator: ``strategy.name: <cls.name>`` selects ``cls``. A second class under a
    name already taken is an error (two families would otherwise shadow each other silently)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} has no string 'name' to be registered under")
    if STRATEGIES.get(name, cls) is not cls:
        raise ValueError(f"strategy name {name!r} is taken by {_where(STRATEGIES[name])}; "
                         f"{_where(cls)} needs another name")
    check_same_meaning([*STRATEGIES.values(), cls])  # an option of a shared name means the same everywhere
    STRATEGIES[name] = cls
    return cls


def handles(task: Task) -> Callable[[Handler], Handler]:
    """Register the decorated function as the client's handler of ``task``."""

    def register_handler(handler: Handler) -> Handler:
        taken = HANDLERS.get(task.name)
        if taken is not None and taken[1] is not handler:
            raise ValueError(f"task {task.name!r} is handled by {_where(taken[1])}; {_where(handler)} "
                             "needs a task of another name")
        HANDLERS[task.name] = (task, handler)
        return handler

    return register_handler


def objective(name: str, config: tuple[str, ...] = ()) -> Callable[[ObjectiveBuilder], ObjectiveBuilder]:
    """Register the decorated function ``(instruction config) -> Objective`` as the local objective
    ``name``; ``config``: the instruction scalars it reads (a ``train`` instruction naming it must
    carry them)."""

    def register_objective(builder: ObjectiveBuilder) -> ObjectiveBuilder:
        taken = OBJECTIVES.get(name)
        if taken is not None and taken[1] is not builder:
            raise ValueError(f"objective {name!r} is built by {_where(taken[1])}; {_where(builder)} needs another name")
        OBJECTIVES[name] = (tuple(config), builder)
        return builder

    return register_objective


def objective_builder(name: str) -> tuple[tuple[str, ...], ObjectiveBuilder] | None:
    """The (config keys, builder) registered as objective ``name``, importing the families first if needed."""
    if name not in OBJECTIVES:
        load_families()
    return OBJECTIVES.get(name)


def load_families() -> None:
    """Import every family (see the module docstring) that is not imported yet. The shipped
    families and the entry points are looked for once per process (scanning every installed
    distribution's metadata costs tens of milliseconds); ``FEDCLUSTER_ALGORITHMS`` is read each time."""
    global _scanned
    with _lock:
        if not _scanned:
            built_in = importlib.import_module(BUILT_IN)
            for found in pkgutil.iter_modules(built_in.__path__):
                if found.ispkg and found.name not in SHARED_PACKAGES:
                    _load(f"{BUILT_IN}.{found.name}", "")
            for point in entry_points(group=ENTRY_POINT_GROUP):
                _load(point.value, f"entry point {point.name!r} of group {ENTRY_POINT_GROUP!r}")
            _scanned = True
        for name in filter(None, (n.strip() for n in os.environ.get(FAMILIES_VARIABLE, "").split(","))):
            _load(name, f"environment variable {FAMILIES_VARIABLE}")


def _load(module: str, named_by: str) -> None:
    """Import ``module``; a family named from outside (``named_by``) that fails to import, for
    whatever reason, is a :class:`FamilyImportError` naming who named it (a shipped one raises as is)."""
    if module in _loaded:
        return
    try:
        importlib.import_module(module.split(":", 1)[0])
    except Exception as err:
        if not named_by:
            raise
        raise FamilyImportError(
            f"algorithm family {module!r} (named by {named_by}) cannot be imported: {type(err).__name__}: {err}"
        ) from err
    _loaded.add(module)


def strategies() -> dict[str, type]:
    """Every registered strategy, by name, sorted by name (whatever order the families loaded in)."""
    load_families()
    return dict(sorted(STRATEGIES.items()))


def strategy_class(name: str) -> Any:
    """The strategy registered as ``name`` (KeyError if none)."""
    return strategies()[name]


def handler(task_name: str) -> tuple[Task, Handler] | None:
    """The (task, handler) registered for ``task_name``, importing the families first if needed."""
    if task_name not in HANDLERS:
        load_families()
    return HANDLERS.get(task_name)


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
