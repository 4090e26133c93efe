"""A config's YAML read: a file, or a ``--set`` value, refusing what a config cannot mean.

PyYAML would read a key given twice without a word (the last wins), follow aliases however they
expand (one that holds itself ended in a RecursionError, a 1.2 KB "billion laughs" in a
MemoryError after 38 s), recurse once per level of nesting and read a file of any size. Here,
before anything is built: a key given twice is an error naming it and both lines; an alias (and
so an anchor's use, merge keys included) is refused at the first one; nesting stops at
:data:`MAX_NESTING` levels and a file at :data:`MAX_CONFIG_BYTES`; a file that is not UTF-8 text,
or not a regular file, is named as such. Each is a :class:`~fedcluster_flwr.declarations.schema.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..declarations.schema import ConfigError


# A config file is a few KB (the largest shipped one is 3.5 KB); a file far beyond that is another
# file given by mistake, which PyYAML would take minutes and gigabytes to build (its constructor,
# Python even behind libyaml's parser, builds some 25,000 list items a second on a loaded 2-core
# machine: a 26 MB list took 148 s before a MemoryError). 256 KB holds lists of thousands of
# entries and is read in seconds.
MAX_CONFIG_BYTES = 256_000
# A config is three levels deep (simulation.fail_fit.3 is a list); deeper is not a config, and
# PyYAML's composer recurses once per level (a file of "[[[[..." ended in a RecursionError).
MAX_NESTING = 20


class _Refused(yaml.YAMLError):
    """YAML that parses but that a config refuses: where in the config (``path``, keys and list
    positions; empty: the whole text), why, and where in the text (``"lines 4 and 6"``), which the
    caller words with the file it read."""

    def __init__(self, path: Sequence[str | int], message: str, where: str) -> None:
        self.path = list(path)
        self.message = message
        self.where = where
        super().__init__(f"{_dotted(path) or 'config'}: {message} ({where})")


# libyaml's parser where PyYAML has it (its wheels do): ten times PyYAML's own.
_Parser = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader


class _Loader(_Parser):  # type: ignore[misc, valid-type]
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``)."""


@dataclass
class _Open:
    """A mapping or list whose events :func:`_refuse_what_a_config_cannot_mean` is inside."""

    label: str | int | None  # its key in its parent, or its position there (None: the document)
    is_mapping: bool
    keys: dict[Any, Any] = dataclasses.field(default_factory=dict)  # a mapping's keys so far: where each was
    expects_key: bool = True  # a mapping's next node is a key (else that key's value)
    key: str = "?"  # a mapping's current key
    items: int = 0  # a list's items so far


def _refuse_what_a_config_cannot_mean(text: str) -> None:
    """Raise :class:`_Refused` at the first thing in ``text`` a config cannot mean, read from the
    parser's events before anything is built: a key given twice in one mapping (YAML keeps the
    last without a word), an alias (``*name``, also in merge keys: one alias that holds itself, or
    a few nested ones, expand without bound: the "billion laughs"), nesting beyond
    :data:`MAX_NESTING` (the composer recurses once per level)."""
    loader = _Loader(text)
    stack: list[_Open] = []  # the collections the parser is inside, outermost first
    try:
        while loader.check_event():
            event = loader.get_event()
            line = f"line {event.start_mark.line + 1}"
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                stack.pop()
                _node_done(stack)
                continue
            if not isinstance(event, (yaml.AliasEvent, yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                continue  # stream and document events
            parent = stack[-1] if stack else None
            is_key = parent is not None and parent.is_mapping and parent.expects_key
            label = None if parent is None else "?" if is_key else parent.key if parent.is_mapping else parent.items
            here = [entry.label for entry in stack[1:]] + ([] if label is None else [label])
            if isinstance(event, yaml.AliasEvent):
                raise _Refused(here, f"is the YAML alias *{event.anchor}; a config takes no anchors or aliases "
                                     "(nor merge keys <<: *name): write the values out", line)
            if is_key and isinstance(event, yaml.ScalarEvent):
                key = _scalar_value(loader, event)
                if key in parent.keys:
                    first, again = parent.keys[key], event.start_mark
                    where = (f"line {again.line + 1}, columns {first.column + 1} and {again.column + 1}"
                             if first.line == again.line else f"lines {first.line + 1} and {again.line + 1}")
                    raise _Refused(here[:-1] + [str(key)], "given twice; YAML would keep the last without a word: "
                                                           "keep one", where)
                parent.keys[key], parent.key = event.start_mark, str(key)
            if isinstance(event, yaml.ScalarEvent):
                _node_done(stack)
                continue
            stack.append(_Open(label, isinstance(event, yaml.MappingStartEvent)))
            if len(stack) > MAX_NESTING:
                raise _Refused([], f"nested more than {MAX_NESTING} levels deep; a config is a few levels deep", line)
    finally:
        loader.dispose()


def _node_done(stack: list[_Open]) -> None:
    """A whole node (a scalar, or a collection up to its end) was read inside ``stack[-1]``."""
    if stack and stack[-1].is_mapping:
        stack[-1].expects_key = not stack[-1].expects_key
    elif stack:
        stack[-1].items += 1


def _scalar_value(loader: _Loader, event: yaml.ScalarEvent) -> Any:
    """A key as the constructor will build it: ``1`` and ``0x1``, or ``true`` and ``yes``, are one key."""
    tag = event.tag if event.tag not in (None, "!") else loader.resolve(yaml.ScalarNode, event.value, event.implicit)
    try:
        return loader.construct_object(yaml.ScalarNode(tag, event.value))
    except (yaml.YAMLError, ValueError, TypeError):
        return event.value


def _dotted(path: Sequence[str | int]) -> str:
    """``["simulation", "fail_fit", "3", 0]`` -> ``simulation.fail_fit.3[0]``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_value(text: str, key: str = "--set") -> Any:
    """A ``--set`` value of ``key``: YAML scalar or flow list (``[0, 180]``), else the raw string.
    What a config refuses in a file (an alias, a key given twice) is refused here too."""
    try:
        _refuse_what_a_config_cannot_mean(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except _Refused as err:
        raise ConfigError(_dotted([key, *err.path]), err.message) from None
    except yaml.YAMLError:
        return text


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        # A folder exists, so "file not found" would send the user looking for the wrong mistake.
        found = sorted(p.name for p in path.glob("*.y*ml"))
        examples = f" in it, e.g. {path / found[0]}" if found else ""
        raise ConfigError("config", f"{path} is a folder, not a config file: give a YAML file{examples}")
    if not path.exists():
        raise ConfigError("config", f"file not found: {path}")
    if not path.is_file():  # a device or a pipe (/dev/zero, <(...)): it may never end
        raise ConfigError("config", f"{path} is not a regular file: give a YAML file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is {size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,} "
                                    "(a few thousand is usual): is it the right file?")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("config", f"{path} is not a text file (byte {err.start} is not UTF-8)") from None
    try:
        _refuse_what_a_config_cannot_mean(text)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except _Refused as err:
        raise ConfigError(_dotted(err.path) or "config", f"{err.message} ({path}, {err.where})") from None
    except yaml.YAMLError as err:
        err = _in_pyyamls_words(text, err)
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigError("config", f"{path} is not valid YAML: {problem}{where}") from None
    if data is None:  # otherwise reported as the first key a config needs ("model.name: is required")
        raise ConfigError("config", f"{path} is empty (no keys, or only comments): a config file needs at least "
                                    "model.name; see conf/default.yaml")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def _in_pyyamls_words(text: str, err: yaml.YAMLError) -> yaml.YAMLError:
    """A syntax error as PyYAML's own parser words it (``expected ',' or ']', but got '<stream
    end>'``), which says what it found where libyaml only says ``did not find expected ',' or ']'``:
    the text, at most :data:`MAX_CONFIG_BYTES`, parsed again to its error, building nothing."""
    if _Parser is yaml.SafeLoader:
        return err
    try:
        for _ in yaml.parse(text, Loader=yaml.SafeLoader):
            pass
    except yaml.YAMLError as python_err:
        return python_err
    return err
