"""YAML as configs are read: safe, bounded in size, without aliases, and without a key given twice.

A config is read on a shared head node (``headsweep submit``), so it must not be able to take memory there: a
file is at most :data:`MAX_CONFIG_BYTES`, and YAML aliases (``*name``) are refused, because nine nested aliases
("billion laughs") expand a few hundred bytes into gigabytes. ``include:`` is the way to share values between
configs. A key given twice in one mapping is refused too: YAML loaders keep the last one silently, which runs a
different sweep from the one the reader of the file sees first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from headsweep.errors import HeadsweepError

MAX_CONFIG_BYTES = 1024 * 1024
# Collections inside collections: a config needs a handful (sweep.masks is a list of lists in a mapping). Python's
# recursion, in the YAML composer and in the reader after it, ends a few hundred levels down.
MAX_NESTING = 32


class _Refused(yaml.YAMLError):
    """A construct configs do not accept, with the line it is on."""

    def __init__(self, mark: Any, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _ConfigLoader(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self._depth >= MAX_NESTING:
            raise _Refused(self.peek_event().start_mark,
                           f"values nest more than {MAX_NESTING} levels deep (a config needs a handful)")
        self._depth += 1
        try:
            return self._compose_one(parent, index)
        finally:
            self._depth -= 1

    def _compose_one(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(
                event.start_mark,
                f"YAML alias *{event.anchor} is not accepted in configs (aliases can expand without bound); "
                "share values between configs with include: instead",
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the base constructor names it
                break
            if earlier is not None:
                raise _Refused(key_node.start_mark, f"key {key!r} is given twice (first on line {earlier})")
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as ``line L, column C: problem`` (1-based, as editors count)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def parse_yaml(text: str) -> Any:
    """``text`` parsed as a config value; raises ``yaml.YAMLError`` (aliases and repeated keys included)."""
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - _ConfigLoader is a SafeLoader


def read_yaml_file(path: Path) -> Any:
    """The YAML document in config file ``path``; one-line errors naming the file."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise HeadsweepError(
            f"config file {path} is {size:,} bytes; a config is at most {MAX_CONFIG_BYTES:,} bytes "
            "(data and lists of masks belong in files the config names)"
        )
    try:
        return parse_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise HeadsweepError(f"config file {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except _Refused as exc:
        raise HeadsweepError(f"config file {path}: {yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise HeadsweepError(f"config file {path} is not valid YAML: {yaml_problem(exc)}") from None


def parse_override(item: str, raw: str) -> Any:
    """The value of override ``item`` (``key=raw``): YAML, or the text itself where it is not YAML. A tag YAML's safe
    loader does not know (``!!python/object/apply:...``, ``!function``) is refused, as it is in a file, rather than
    read as text the user did not mean."""
    try:
        return parse_yaml(raw) if raw else ""
    except _Refused as exc:
        raise HeadsweepError(f"bad override {item!r}: {exc.problem}") from None
    except yaml.constructor.ConstructorError as exc:
        raise HeadsweepError(f"bad override {item!r}: {exc.problem} (configs take only YAML's standard tags, as in a "
                             "config file); quote the value if you mean it as text") from None
    except yaml.YAMLError:
        return raw
