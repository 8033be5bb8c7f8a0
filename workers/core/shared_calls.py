"""Telling apart the calls of one module that a model runs several times per forward pass (ALBERT's shared layer).

A shared attention module is one set of weights applied at several depths; each application is its own attention
site (its own heads, gates, fills, recorded contexts), but every hook lands on the same module. A
:class:`CallCounter` says which call of the module is running: a forward pre-hook on the module that loops over the
applications resets it at the start of each of its forwards, and a forward pre-hook on the shared module itself
(registered first) steps it, so every hook that runs inside the module's call (on the module or on its output
projection) and the forward hook after it see the same call index. A site bound to call ``c``
(:class:`SharedCall`) acts only while ``c`` runs. After each forward of the loop the counts are checked against the
calls the model was described with, so a model that calls its modules in another pattern stops with an error
instead of gating the wrong application.

The hooks are callable objects rather than closures so that a deep copy of the model gets its own counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headsweep.errors import HeadsweepError

if TYPE_CHECKING:  # the driver reads SHARED_ATTENTION and shared_refusal: torch stays out of its import time
    from torch import nn

#: Attribute of the looping module that holds its :class:`SharedCalls` (installed once per model).
ATTRIBUTE = "headsweep_shared_calls"
#: ``DatasetInfo.facts`` key of a model that runs attention modules at several depths (ALBERT): each such module's
#: name and the layers (applications) it runs as; the driver refuses by it what cannot be exact for shared weights.
SHARED_ATTENTION = "shared_attention"


def shared_refusal(what: str, shared: Mapping[str, Sequence[int]]) -> str:
    """The one line refusing ``what`` (physical pruning, in some form) for a model whose modules ``shared`` (name ->
    the layers it runs as) are applied at several depths: a head leaves shared weights only if it leaves every
    application."""
    name, layers = next(iter(shared.items()))
    return (f"{what} is not supported for a layer shared across depths: {name} runs as "
            f"{', '.join(f'self:{n}' for n in layers)} (one set of weights), and a head leaves shared weights only "
            "if it leaves every application")


class CallCounter:
    """Which call of one shared module is running in the current forward pass (-1: none yet)."""

    def __init__(self, module_name: str, calls: int):
        self.module_name = module_name
        self.calls = calls  # how many times one forward pass of the loop calls the module
        self.current = -1

    def __call__(self, _module: nn.Module, _args: tuple) -> None:  # forward pre-hook on the shared module
        self.current += 1


@dataclass(frozen=True)
class SharedCall:
    """An attention site that is call ``index`` of a shared module (counted by ``counter``) in each forward pass."""

    counter: CallCounter
    index: int

    def running(self) -> bool:
        """Whether this call of the shared module is the one running now."""
        return self.counter.current == self.index


class SharedCalls:
    """The counters of every shared module under one looping module: reset before its forward, checked after."""

    def __init__(self, counters: Sequence[CallCounter]):
        self.counters = list(counters)

    def reset(self, _module: nn.Module, _args: tuple) -> None:  # forward pre-hook on the looping module
        for counter in self.counters:
            counter.current = -1

    def check(self, module: nn.Module, _args: tuple, _output: Any) -> None:  # forward hook on the looping module
        for counter in self.counters:
            if counter.current + 1 != counter.calls:
                raise HeadsweepError(
                    f"{counter.module_name} ran {counter.current + 1} times in one forward pass of "
                    f"{type(module).__name__}, not the {counter.calls} its applications were numbered for: its heads "
                    "cannot be told apart per application")


def install_counters(loop: nn.Module, shared: dict[str, tuple[nn.Module, int]]) -> dict[str, CallCounter]:
    """Count the calls of each shared module (``name -> (module, calls per forward)``) within each forward of
    ``loop``; returns the counters by module name. Installed once: a second call returns the first's counters."""
    installed = getattr(loop, ATTRIBUTE, None)
    if isinstance(installed, SharedCalls):
        return {c.module_name: c for c in installed.counters}
    counters = {name: CallCounter(name, calls) for name, (_module, calls) in shared.items()}
    for name, (module, _calls) in shared.items():
        module.register_forward_pre_hook(counters[name], prepend=True)
    calls = SharedCalls(list(counters.values()))
    loop.register_forward_pre_hook(calls.reset, prepend=True)
    loop.register_forward_hook(calls.check)
    setattr(loop, ATTRIBUTE, calls)
    return counters
