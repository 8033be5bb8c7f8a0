"""Python that an lm-eval task file would make lm-eval run, found before lm-eval reads it.

lm-eval task YAML files may carry code: ``!function module.name`` imports ``module.py`` from the file's own folder
(or any importable module) when the task loads, and a ``class:`` entry builds the task from such a function's
class. headsweep promises that a config never makes it run code, so a task outside lm-eval's own package whose
files hold either is refused, in one line naming the file, its line and the entry, unless the config opts in with
``data.trust_task_code: true``. lm-eval's own tasks (files inside its installed package) carry code the installed
package already is, and are read as they are.

Templates are code too: lm-eval renders ``doc_to_text``, ``doc_to_choice`` and the like with a plain Jinja
environment, where ``{{ cycler.__init__.__globals__.os.system(...) }}`` runs a shell command. Untrusted, they are
rendered in Jinja's sandbox instead (:func:`sandbox_templates`), which renders every ordinary template alike and
refuses such an expression; :func:`template_refusal` turns the refusal into the line the user reads.

The files looked at are those lm-eval reads to build the tasks named: each task's, group's or tag's file, its
members' and every file they ``include:``. They are composed (parsed to nodes) here, never constructed, so this
check itself runs nothing; any tag other than YAML's own standard ones counts, since lm-eval's only other reading
of a tag is to skip the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headsweep.errors import HeadsweepError

# Tags YAML resolves by itself (str, int, map, ...): data. ``tag:yaml.org,2002:python/...`` is PyYAML's code.
STANDARD_TAG = "tag:yaml.org,2002:"
# Top-level keys whose value lm-eval calls as code (a Python task class).
CODE_KEYS = ("class",)
# lm-eval's own Jinja environment, kept while the sandbox stands in for it (sandbox_templates)
_LM_EVAL_ENV: Any = None


def refuse_task_code(manager: Any, names: list[str], key: str = "data") -> None:
    """One line, naming the file, line and entry, when a task of ``names`` (or a group's or tag's member) in
    ``manager``'s index would run Python from outside lm-eval's own package."""
    for path in task_files(manager, names):
        found = find_code(path)
        if found is not None:
            where, entry = found
            raise HeadsweepError(
                f"lm-eval task file {where}: {entry} makes lm-eval import and run Python from the task folder; "
                f"headsweep runs no code from a config unless you trust it: set {key}.trust_task_code: true "
                "(only for task files you trust), or remove the entry")


def sandbox_templates(on: bool) -> None:
    """Render lm-eval's task templates in Jinja's sandbox (``on``: task code not trusted) or in lm-eval's own
    environment, in this process (lm-eval reads its module-level environment at every rendering)."""
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    global _LM_EVAL_ENV
    if _LM_EVAL_ENV is None:
        _LM_EVAL_ENV = utils.env
    if not on:
        utils.env = _LM_EVAL_ENV
        return
    if isinstance(utils.env, SandboxedEnvironment):
        return
    sandbox = SandboxedEnvironment(loader=_LM_EVAL_ENV.loader, undefined=_LM_EVAL_ENV.undefined,
                                   keep_trailing_newline=_LM_EVAL_ENV.keep_trailing_newline)
    sandbox.filters.update(_LM_EVAL_ENV.filters)
    utils.env = sandbox


def template_refusal(exc: BaseException, task: str, key: str = "data") -> HeadsweepError | None:
    """The line for a template the sandbox refused (``jinja2.exceptions.SecurityError``); None for another error."""
    from jinja2.exceptions import SecurityError

    if not isinstance(exc, SecurityError):
        return None
    cause = str(exc).rstrip(".")
    return HeadsweepError(
        f"lm-eval task {task!r}: a template of its task file reaches into Python ({cause}), which would run code; "
        f"headsweep renders task templates in Jinja's sandbox unless you trust them: set {key}.trust_task_code: true "
        "(only for task files you trust), or fix the template")


def task_files(manager: Any, names: list[str]) -> list[Path]:
    """The YAML files outside lm-eval's package that lm-eval reads to build ``names`` (groups and tags with their
    members), in order, each once."""
    index = manager.task_index
    own = _package_root()
    files: list[Path] = []
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop(0)
        if name in seen or name not in index:
            continue
        seen.add(name)
        entry = index[name]
        todo += _tag_members(entry)
        path = _yaml_path(entry)
        if path is None:
            continue
        todo += _group_members(path)
        if not path.resolve().is_relative_to(own) and path not in files:
            files.append(path)
    return files


def find_code(path: Path, seen: frozenset[Path] = frozenset()) -> tuple[str, str] | None:
    """``(file: line N, entry)`` of the first code-loading tag or key in the YAML file ``path`` or a file it
    includes (outside lm-eval's package); None when it holds data only."""
    import yaml

    path = path.resolve()
    if path in seen or path.is_relative_to(_package_root()) or not path.is_file():
        return None  # a cycle, lm-eval's own file, or one lm-eval cannot read either (it says so when loading)
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=_loader())
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return None  # lm-eval skips a file it cannot parse; task_manager names it when a task is missing
    if root is None:
        return None
    for node in _nodes(root):
        if not node.tag.startswith(STANDARD_TAG) or node.tag.startswith(STANDARD_TAG + "python/"):
            return f"{path}: line {node.start_mark.line + 1}", f"`{_shown(node)}`"
    if isinstance(root, yaml.MappingNode):
        for k, _ in root.value:
            if isinstance(k, yaml.ScalarNode) and k.value in CODE_KEYS:
                return f"{path}: line {k.start_mark.line + 1}", f"`{k.value}:` (a Python task class)"
        for k, v in root.value:
            if isinstance(k, yaml.ScalarNode) and k.value == "include":
                for include in _scalars(v):
                    found = find_code(path.parent / include, seen | {path})
                    if found is not None:
                        return found
    return None


def _shown(node: Any) -> str:
    """A tagged node as it is written: ``!function evilmod.process_docs``, ``!!python/name:os.system``."""
    import yaml

    tag = node.tag.replace(STANDARD_TAG, "!!", 1)
    value = node.value if isinstance(node, yaml.ScalarNode) else "..."
    return f"{tag} {value}" if value else tag


def _nodes(root: Any) -> Iterator[Any]:
    """Every node under ``root``, each once (aliases share nodes: an alias bomb is walked in linear time)."""
    import yaml

    stack, visited = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        yield node
        if isinstance(node, yaml.SequenceNode):
            stack += reversed(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in reversed(node.value):
                stack += [v, k]


def _scalars(node: Any) -> list[str]:
    import yaml

    if isinstance(node, yaml.ScalarNode):
        return [node.value]
    if isinstance(node, yaml.SequenceNode):
        return [n.value for n in node.value if isinstance(n, yaml.ScalarNode)]
    return []


def _group_members(path: Path) -> list[str]:
    """The task, group and tag names a group file lists (``task:`` as a list: names, or mappings with a ``task``
    name); empty for a task's file."""
    import yaml

    class Loader(_loader()):  # type: ignore[misc, valid-type]
        """Tags read as plain values: only the names are wanted."""

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    try:
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return []
    members = cfg.get("task") if isinstance(cfg, dict) and "group" in cfg else None
    if not isinstance(members, list):
        return []
    names = []
    for member in members:
        if isinstance(member, str):
            names.append(member)
        elif isinstance(member, dict) and isinstance(member.get("task"), str):
            names.append(member["task"])
    return names


def _tag_members(entry: Any) -> list[str]:
    """A tag's tasks: ``Entry.tags`` of a tag entry (lm-eval 0.4.10 on), or the ``task`` list of the older index's
    ``{"type": "tag", "task": [...]}``."""
    if isinstance(entry, dict):
        return list(entry.get("task") or []) if entry.get("type") == "tag" else []
    kind = getattr(getattr(entry, "kind", None), "name", "")
    return sorted(getattr(entry, "tags", None) or []) if kind == "TAG" else []


def _yaml_path(entry: Any) -> Path | None:
    path = entry.get("yaml_path") if isinstance(entry, dict) else getattr(entry, "yaml_path", None)
    return Path(path) if isinstance(path, (str, Path)) and str(path) not in ("", "-1") else None


def _loader() -> type:
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _package_root() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent
