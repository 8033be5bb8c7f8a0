"""The user documentation cannot drift from the code: docs/configuration.md documents every config key with its
default, and no key that does not exist; every relative link of the Markdown pages points at a file (and a heading)
that exists.

docs/configuration.md holds one table per config section, ``| key | default | meaning |``, under a heading whose
code spans name the section: ``## `sweep` ``, ``### `model` for `hf_classifier` `` (a model family's section), or
``## Top level`` (no code span: the keys outside any section). A key is written whole (``sweep.workers``), its
default as YAML in the default cell's first code span (``null``, ``600``, ``[baseline, single_head]``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from headsweep.sweep.configuration.ablation import methods_reading, section_for
from headsweep.sweep.configuration.sections import config_class
from headsweep.sweep.experiments import BUILTIN_KINDS, KINDS  # importing the kinds registers their config sections
from headsweep.sweep.run.screening import DEFAULTS as SCREEN_DEFAULTS
from headsweep.workers.ablation.method import COMMON_SETTINGS
from headsweep.workers.core.setting_ranges import Range, range_of
from headsweep.workers.families.registry import builtin_families

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION = REPO / "docs" / "configuration.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md",
         REPO / "results" / "README.md", REPO / "k8s" / "README.md"]
MISSING = object()  # a key without a default (required)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def _flatten(cls: type, prefix: str, section: tuple[str, ...], out: dict) -> None:
    """The keys of dataclass ``cls`` (config prefix ``prefix``) into ``out[section]``; a field that is itself a
    dataclass is a section of its own."""
    hints = typing.get_type_hints(cls)
    keys = out.setdefault(section, {})
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            _flatten(hints[f.name], key, (key,), out)
        else:
            keys[key] = _default(f)


def _sections(ablation: str) -> dict[str, Any]:
    """The config's fields by name, typed: a section's dataclass (the ``ablation`` section that of a config whose
    ``sweep.ablation`` is ``ablation``: built from the methods' settings), or a top-level key's type."""
    config = config_class()
    hints = typing.get_type_hints(config)
    return {f.name: section_for(ablation) if f.name == "ablation" else hints[f.name]
            for f in dataclasses.fields(config) if f.name not in ("model", "data")}


def code_keys(ablation: str = "zero") -> dict[tuple[str, ...], dict[str, Any]]:
    """Every config key the code reads, by documentation section, with its default.

    The sections every config has and those the experiment kinds register (the whole :func:`config_class`; the
    ``ablation`` section of a config naming method ``ablation``, the built-in methods' by default), the keys of
    ``sweep.screen`` (a mapping the screening policy reads), and each built-in model family's ``model`` and ``data``
    sections.
    """
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    config = config_class()
    top = out.setdefault((), {})
    sections = _sections(ablation)
    for f in dataclasses.fields(config):
        if f.name in ("model", "data"):
            continue
        if dataclasses.is_dataclass(sections[f.name]):
            _flatten(sections[f.name], f.name, (f.name,), out)
        else:
            top[f.name] = _default(f)
    out[("sweep.screen",)] = {f"sweep.screen.{k}": v for k, v in SCREEN_DEFAULTS.items()}
    for family in builtin_families():
        _flatten(family.model_config, "model", ("model", family.name), out)
        _flatten(family.data_config, "data", ("data", family.name), out)
    return out


def _cells(line: str) -> list[str]:
    """A table row's cells (an escaped ``\\|`` stays inside its cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def documented_keys(text: str) -> tuple[dict[tuple[str, ...], dict[str, str]], list[str]]:
    """The ``key | default | meaning`` tables of a page, by the section their heading names, and what is malformed:
    a key outside its heading's section, a key twice, a row without a default or a meaning."""
    out: dict[tuple[str, ...], dict[str, str]] = {}
    problems: list[str] = []
    section: tuple[str, ...] | None = None
    in_table = False
    for n, line in enumerate(text.splitlines(), 1):
        heading = re.match(r"#{2,6} (.*)", line)
        if heading:
            section, in_table = tuple(re.findall(r"`([^`]+)`", heading.group(1))), False
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if cells[:3] == ["key", "default", "meaning"]:
            if section is None:
                problems.append(f"line {n}: a key table before any section heading")
            in_table = True
            out.setdefault(section or (), {})
            continue
        if not in_table or set(line) <= set("|- "):
            continue
        assert section is not None
        key = re.fullmatch(r"`([^`]+)`", cells[0])
        if len(cells) != 3 or not key or not cells[2]:
            problems.append(f"line {n}: a row must be | `key` | `default` | meaning |: {line}")
            continue
        name = key.group(1)
        prefix = f"{section[0]}." if section else ""
        rest = name[len(prefix):]
        if not name.startswith(prefix) or not rest or (not section and "." in name) or (section and "." in rest):
            problems.append(f"line {n}: key {name} is not a key of the section its heading names "
                            f"({section[0] if section else 'top level'})")
        if name in out[section]:
            problems.append(f"line {n}: key {name} documented twice in its section")
        out[section][name] = cells[1]
    return out, problems


def _same(documented: Any, actual: Any) -> bool:
    if isinstance(actual, bool) or isinstance(documented, bool):
        return documented is actual
    if isinstance(actual, int | float) and isinstance(documented, int | float):
        return math.isclose(documented, actual, rel_tol=1e-12, abs_tol=1e-12)
    if isinstance(actual, list) and isinstance(documented, list):
        return len(actual) == len(documented) and all(_same(d, a) for d, a in zip(documented, actual, strict=True))
    return documented == actual


def compare(documented: dict[tuple[str, ...], dict[str, str]], actual: dict[tuple[str, ...], dict[str, Any]],
            ) -> list[str]:
    """What differs between the documented keys and the code's, both ways, one line each."""
    problems = []
    for section in sorted(set(documented) - set(actual)):
        problems.append(f"section {' / '.join(section) or 'top level'} is documented but the code has no such "
                        f"section: {', '.join(documented[section])}")
    for section in sorted(actual):
        where = " / ".join(section) or "top level"
        docs = documented.get(section, {})
        missing = [k for k in actual[section] if k not in docs]
        extra = [k for k in docs if k not in actual[section]]
        if missing:
            problems.append(f"{where}: keys the code reads but docs/configuration.md does not document: "
                            f"{', '.join(missing)}")
        if extra:
            problems.append(f"{where}: keys docs/configuration.md documents but the code does not read: "
                            f"{', '.join(extra)}")
        for key in actual[section]:
            if key not in docs:
                continue
            cell, default = docs[key], actual[section][key]
            span = re.search(r"`([^`]*)`", cell)
            if default is MISSING:
                if span is not None or "required" not in cell:
                    problems.append(f"{key}: required (no default), documented default {cell!r}: write 'required'")
                continue
            if span is None:
                problems.append(f"{key}: documented default {cell!r} has no `code span`; the code's is {default!r}")
                continue
            try:
                value = yaml.safe_load(span.group(1))
            except yaml.YAMLError:
                value = span.group(1)
            if not _same(value, default):
                problems.append(f"{key}: documented default `{span.group(1)}` but the code's is {default!r}")
    return problems


def test_configuration_reference_matches_the_config_dataclasses():
    documented, malformed = documented_keys(CONFIGURATION.read_text())
    problems = malformed + compare(documented, code_keys())
    assert not problems, "docs/configuration.md is out of date:\n" + "\n".join(problems)


def test_the_comparison_sees_missing_extra_and_wrong_defaults():
    """The check above can fail: a page missing a key, naming one that does not exist and giving a wrong default
    is reported on each count, and so is a key under the wrong heading."""
    page = """
## `sweep`

| key | default | meaning |
| --- | --- | --- |
| `sweep.workers` | `2` | worker actors |
| `sweep.colour` | `red` | not a key |
| `significance.alpha` | `0.01` | under the wrong heading |

### `model` for `hf_classifier`

| key | default | meaning |
| --- | --- | --- |
| `model.path` | `""` (required) | the folder |
"""
    documented, malformed = documented_keys(page)
    actual = {("sweep",): {"sweep.workers": 1, "sweep.device": "auto"},
              ("model", "hf_classifier"): {"model.path": ""}}
    problems = compare(documented, actual)
    assert malformed == ["line 8: key significance.alpha is not a key of the section its heading names (sweep)"]
    assert "sweep: keys the code reads but docs/configuration.md does not document: sweep.device" in problems
    assert any(p.startswith("sweep: keys docs/configuration.md documents but the code does not read: sweep.colour")
               for p in problems)
    assert "sweep.workers: documented default `2` but the code's is 1" in problems
    assert not any("model.path" in p for p in problems)
    family = {("model", "hf_classifier"): {"model.path": ""}}
    assert compare({("model", "hf_classifier"): {"model.path": "`x`"}}, family) == \
        ["model.path: documented default `x` but the code's is ''"]


def test_code_keys_cover_every_section_and_family():
    """What the check compares with: each registered section, ``sweep.screen`` and every built-in family's model
    and data sections, with real defaults (a spot check of each kind of source)."""
    keys = code_keys()
    assert keys[()] == {"name": "sweep", "seed": 0, "checkpoints": None}
    assert keys[("sweep",)]["sweep.workers"] == 1
    assert keys[("ablation",)]["ablation.steps"] == 100
    assert keys[("l0",)]["l0.beta"] == 0.33
    assert keys[("sweep.screen",)]["sweep.screen.miss"] == 0.05
    assert {s[1] for s in keys if len(s) == 2 and s[0] in ("model", "data")} == \
        {"hf_classifier", "hf_causal_lm", "fairseq_translation", "hf_seq2seq"}
    assert keys[("data", "hf_causal_lm")]["data.target_delimiter"] == " "
    kind_sections = {KINDS[k].section for k in BUILTIN_KINDS if KINDS[k].settings is not None}
    assert kind_sections == {"importance", "prune", "efficiency", "roles", "pairs", "l0"}
    assert all((section,) in keys for section in kind_sections)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _prose(text: str) -> str:
    """A page without its fenced code blocks (links and headings inside them are examples, not links)."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """The relative links of ``page`` whose file, or heading in a Markdown file, does not exist (named relative to
    ``root``)."""
    text = re.sub(r"`[^`\n]*`", "", _prose(page.read_text()))
    out = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            out.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            out.append(f"{page.relative_to(root)}: {target} (no heading with that anchor in {file.name})")
    return out


def test_every_relative_link_points_at_a_file_that_exists():
    missing = [p for p in PAGES if not p.is_file()]
    assert not missing, missing
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## The `sweep` section\n")
    page.write_text("# Page\n\n[ok](other.md#the-sweep-section) [self](#page) [web](https://example.org/x)\n"
                    "[gone](missing.md) [bad anchor](other.md#nothing) `[code](nowhere.md)`\n"
                    "```\n[example](nowhere.md)\n```\n")
    assert broken_links(page, tmp_path) == ["page.md: missing.md (no such file)",
                                            "page.md: other.md#nothing (no heading with that anchor in other.md)"]


# -- the ranges of numeric settings ---------------------------------------------------------------------------
def _numeric(tp: Any) -> bool:
    """Whether a field of type ``tp`` holds a number or a list of numbers (``int``, ``float | None``, ...)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return bool(args) and _numeric(args[0])
    if args:
        return any(_numeric(a) for a in args)
    return tp in (int, float)


def _ranged_fields(cls: type, prefix: str, section: tuple[str, ...], out: dict) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            _ranged_fields(hints[f.name], key, (key,), out)
        elif _numeric(hints[f.name]):
            out[(section, key)] = range_of(f)


def code_ranges(ablation: str = "zero") -> dict[tuple[tuple[str, ...], str], Range | None]:
    """Every numeric config key, by documentation section, with the range its field declares (None: none)."""
    out: dict = {}
    config = config_class()
    sections = _sections(ablation)
    for f in dataclasses.fields(config):
        if f.name in ("model", "data"):
            continue
        if dataclasses.is_dataclass(sections[f.name]):
            _ranged_fields(sections[f.name], f.name, (f.name,), out)
        elif _numeric(sections[f.name]):
            out[((), f.name)] = range_of(f)
    for family in builtin_families():
        _ranged_fields(family.model_config, "model", ("model", family.name), out)
        _ranged_fields(family.data_config, "data", ("data", family.name), out)
    return out


def documented_meanings(text: str) -> dict[tuple[tuple[str, ...], str], str]:
    """The meaning cell of each documented key, by section (the tables :func:`documented_keys` reads)."""
    out = {}
    section: tuple[str, ...] = ()
    for line in text.splitlines():
        heading = re.match(r"#{2,6} (.*)", line)
        if heading:
            section = tuple(re.findall(r"`([^`]+)`", heading.group(1)))
            continue
        cells = _cells(line) if line.startswith("|") else []
        key = re.fullmatch(r"`([^`]+)`", cells[0]) if len(cells) == 3 else None
        if key:
            out[(section, key.group(1))] = cells[2]
    return out


def range_problems(documented: dict[tuple[tuple[str, ...], str], str],
                   ranges: dict[tuple[tuple[str, ...], str], Range | None]) -> list[str]:
    """Numeric keys without a declared range, and documented rows that do not state their key's range."""
    problems = []
    for (section, key), bounds in sorted(ranges.items(), key=lambda item: (item[0][0], item[0][1])):
        if bounds is None:
            problems.append(f"{key}: a numeric setting without a declared range (setting_ranges.ranged)")
        elif (section, key) in documented and bounds.text() not in documented[(section, key)]:
            problems.append(f"{key}: docs/configuration.md does not state its range ({bounds.text()!r})")
    return problems


def test_every_numeric_setting_has_a_range_and_the_reference_states_it():
    ranges = code_ranges()
    assert len(ranges) >= 65 and ranges[(("sweep",), "sweep.flush_every")] == Range(low=1)
    problems = range_problems(documented_meanings(CONFIGURATION.read_text()), ranges)
    assert not problems, "numeric settings and their ranges:\n" + "\n".join(problems)


def test_the_range_check_sees_a_missing_range_and_an_unstated_one():
    """The check above can fail: a numeric key without a range, and a row that does not state the range."""
    page = "## `sweep`\n\n| key | default | meaning |\n| --- | --- | --- |\n| `sweep.workers` | `1` | worker actors |\n"
    ranges = {(("sweep",), "sweep.workers"): Range(low=1), (("sweep",), "sweep.colour"): None}
    assert range_problems(documented_meanings(page), ranges) == [
        "sweep.colour: a numeric setting without a declared range (setting_ranges.ranged)",
        "sweep.workers: docs/configuration.md does not state its range ('at least 1')"]


# -- which ablation methods read each key ------------------------------------------------------------------------
def reader_problems(documented: dict[tuple[tuple[str, ...], str], str], keys: list[str]) -> list[str]:
    """``ablation`` rows that do not name (as `` `name` ``) every method that reads their key (its ``settings``);
    ``keep_first``, which every method reads, is exempt."""
    problems = []
    for key, readers in methods_reading(k.split(".", 1)[1] for k in keys).items():
        if key in COMMON_SETTINGS:
            continue
        meaning = documented.get((("ablation",), f"ablation.{key}"))
        missing = [m for m in readers if meaning is not None and f"`{m}`" not in meaning]
        if missing:
            problems.append(f"ablation.{key}: docs/configuration.md does not name the method(s) that read it: "
                            f"{', '.join(missing)}")
    return problems


def test_each_ablation_key_names_the_methods_that_read_it():
    """The ablation section is the methods' settings: each row says which method reads its key, as they declare it,
    and the check can fail (a row naming the wrong method)."""
    documented = documented_meanings(CONFIGURATION.read_text())
    keys = list(code_keys()[("ablation",)])
    assert not reader_problems(documented, keys)
    wrong = {**documented, (("ablation",), "ablation.resamples"): "`mean`: the number of draws"}
    assert reader_problems(wrong, keys) == [
        "ablation.resamples: docs/configuration.md does not name the method(s) that read it: resample"]
