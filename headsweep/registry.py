"""One registry of named things (experiment kinds, model families, ablation methods), as lm-eval's
``api/registry.py`` keeps one for its own.

A :class:`Registry` maps names to entries in registration order (the order messages list them in). An entry is
added by :meth:`Registry.register` (a name taken by another entry is refused) or, when a config names one the
registry does not hold, from an installed entry point of the registry's group (:mod:`headsweep.plugins`: imported,
checked to be of the registry's type and to carry the name it is installed under, then registered). While a run is
going (:meth:`Registry.frozen`) nothing may be registered but such entry points: the driver and its workers must
see the same entries from the run's first row to its last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from headsweep.errors import HeadsweepError
from headsweep.plugins import installed, load_plugin

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Entries of type ``expected`` by name; ``noun`` names one in messages (``ablation method``), ``key`` the config
    key that names one (``sweep.ablation``), ``group`` the entry-point group plugins are installed in.

    ``check(entry)`` refuses an entry that breaks the contract, before anything is added; ``added(entry)`` is what
    registering it brings besides (a kind's config section and results tables); ``unknown(name, known)`` words the
    refusal of a name that is neither registered nor installed.
    """

    def __init__(self, noun: str, key: str, group: str, expected: type[T],
                 check: Callable[[T], None] | None = None, added: Callable[[T], None] | None = None,
                 unknown: Callable[[str, list[str]], str] | None = None):
        super().__init__()
        self.noun, self.key, self.group, self.expected = noun, key, group, expected
        self._check, self._added, self._unknown = check, added, unknown
        self._frozen = 0

    @staticmethod
    def name_of(entry: object) -> str:
        return str(getattr(entry, "name", ""))

    def register(self, entry: T, replace: bool = False) -> T:
        """Add ``entry`` under its name: refused while the registry is frozen, or if the name is another entry's
        (unless ``replace``)."""
        if self._frozen:
            raise HeadsweepError(f"{self.noun} {self.name_of(entry)!r} cannot be registered while a run is going: "
                                 "register it before the run starts")
        name = self.name_of(entry)
        if name in self and self[name] is not entry and not replace:
            raise HeadsweepError(f"{self.noun} {name!r} is registered already")
        if self._check is not None:
            self._check(entry)
        if self._added is not None:
            self._added(entry)
        self[name] = entry
        return entry

    def lookup(self, name: str) -> T:
        """The entry called ``name``: a registered one, or one installed as an entry point of the registry's group
        (imported and registered now, frozen or not); or a clear error listing the known ones."""
        if name in self:
            return self[name]
        plugin = load_plugin(name, self.group, self.expected, self.key)
        if plugin is None:
            known = [*self, *(n for n in installed(self.group) if n not in self)]
            raise HeadsweepError(self._unknown(name, known) if self._unknown is not None else
                                 f"unknown {self.key} {name!r} (known: {', '.join(known)})")
        if self.name_of(plugin) != name:
            raise HeadsweepError(f"{self.noun} entry point {name!r} names a {self.noun.split()[-1]} called "
                                 f"{self.name_of(plugin)!r}: the two names must be the same")
        frozen, self._frozen = self._frozen, 0  # an entry point is what a run may still bring in
        try:
            return self.register(plugin)
        finally:
            self._frozen = frozen

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Within the block, :meth:`register` refuses (entry points named by :meth:`lookup` still load)."""
        self._frozen += 1
        try:
            yield
        finally:
            self._frozen -= 1
