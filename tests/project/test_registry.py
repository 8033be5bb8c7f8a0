"""The one registry the kinds, families and methods share (headsweep/registry.py): names refused twice, entry points
loaded once and checked, nothing registered while a run is going but the entry points its config names."""

from __future__ import annotations

import sys
from types import SimpleNamespace as Thing

import pytest

from headsweep.errors import HeadsweepError
from headsweep.registry import Registry
from headsweep.sweep.experiments import KINDS
from headsweep.workers.ablation.registry import METHODS
from headsweep.workers.families.registry import FAMILIES

GROUP = "headsweep.test_things"

def things() -> Registry[Thing]:
    checked: list[str] = []
    registry = Registry("test thing", "test.thing", GROUP, Thing, check=lambda t: checked.append(t.name))
    registry.register(Thing(name="a"))
    assert checked == ["a"]
    return registry


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """Entry points ``b`` (a Thing called b), ``c`` (a Thing called d) and ``e`` (not a Thing) on ``sys.path``."""
    (tmp_path / "thing_plugins.py").write_text(
        "from types import SimpleNamespace as Thing\nB = Thing(name='b')\nD = Thing(name='d')\nE = 'not a thing'\n")
    dist = tmp_path / "things-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: things\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{GROUP}]\nb = thing_plugins:B\nc = thing_plugins:D\ne = thing_plugins:E\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("thing_plugins", None)


def test_a_name_is_registered_once_unless_replaced() -> None:
    registry = things()
    first = registry["a"]
    assert registry.register(first) is first  # the same entry again: nothing changes
    with pytest.raises(HeadsweepError, match="^test thing 'a' is registered already$"):
        registry.register(Thing(name="a"))
    other = registry.register(Thing(name="a"), replace=True)
    assert registry["a"] is other and list(registry) == ["a"]


def test_entry_points_load_once_checked_and_registered(plugin_path) -> None:
    registry = things()
    b = registry.lookup("b")
    assert b == Thing(name="b") and registry.lookup("b") is b and list(registry) == ["a", "b"]
    with pytest.raises(HeadsweepError, match="^test thing entry point 'c' names a thing called 'd': the two names "
                                             "must be the same$"):
        registry.lookup("c")
    with pytest.raises(HeadsweepError, match=r"^test.thing 'e' \(entry point 'thing_plugins:E'\) is a str, not a "):
        registry.lookup("e")
    with pytest.raises(HeadsweepError, match=r"^unknown test.thing 'z' \(known: a, b, c, e\)$"):
        registry.lookup("z")
    with pytest.raises(HeadsweepError, match="is a module path, and configs never import code"):
        registry.lookup("thing_plugins:B")
    assert "d" not in registry and "z" not in registry


def test_frozen_refuses_registration_but_loads_entry_points(plugin_path) -> None:
    registry = things()
    with registry.frozen():
        with pytest.raises(HeadsweepError, match="^test thing 'x' cannot be registered while a run is going: "
                                                 "register it before the run starts$"):
            registry.register(Thing(name="x"))
        assert registry.lookup("b") == Thing(name="b")  # what the run's config names still comes in
        with pytest.raises(HeadsweepError, match="cannot be registered while a run is going"):
            registry.register(Thing(name="y"))
    assert registry.register(Thing(name="x")) == Thing(name="x")  # open again after the run
    assert list(registry) == ["a", "b", "x"]


def test_the_three_registries_are_one_kind_of_registry() -> None:
    for registry, key in ((KINDS, "experiment kind"), (FAMILIES, "model.kind"), (METHODS, "sweep.ablation")):
        assert isinstance(registry, Registry) and registry.key == key
    assert list(FAMILIES)[:3] == ["hf_classifier", "fairseq_translation", "hf_causal_lm"]
