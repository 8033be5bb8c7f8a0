"""Models that run one layer module at several depths (ALBERT): each application is its own attention site.

ALBERT's ``AlbertTransformer.forward`` (transformers 5) loops ``i`` over ``config.num_hidden_layers`` and calls
``albert_layer_groups[int(i / (num_hidden_layers / num_hidden_groups))]``, whose ``inner_group_num`` ``AlbertLayer``
modules run in order, each with its own ``AlbertAttention``. Application ``L = i * inner_group_num + j`` is layer
``j`` of the group called at step ``i``: the head names' layer counts every call of every attention module in the
order the model runs them (with one group of one layer, the stock ALBERT, ``self:3:1`` is head 1 of the fourth
call of the one shared attention module). A module called more than once per forward gets a call counter
(:mod:`headsweep.workers.core.shared_calls`), and each of its sites acts only during its own call.

A looping module whose groups do not match its config is refused, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from headsweep.errors import HeadsweepError
from headsweep.workers.core.gates import AttentionSite
from headsweep.workers.core.shared_calls import SHARED_ATTENTION, SharedCall, install_counters, shared_refusal
from headsweep.workers.families.hf_shared.layout import attention_layout


@dataclass(frozen=True)
class Application:
    """One call of an attention module in a forward pass: the site's layer number is ``layer``."""

    layer: int
    module_name: str
    call: int  # which call of the module this is, from 0
    calls: int  # how many times one forward pass calls the module


def _is_albert_loop(module: nn.Module) -> bool:
    return any(c.__name__ == "AlbertTransformer" for c in type(module).__mro__[:-1])


def _albert_applications(name: str, loop: nn.Module) -> list[Application]:
    config = loop.config
    layers, groups, inner = (int(config.num_hidden_layers), int(config.num_hidden_groups),
                             int(config.inner_group_num))
    stack = getattr(loop, "albert_layer_groups", None)
    if not isinstance(stack, nn.ModuleList) or len(stack) != groups or any(
            len(getattr(g, "albert_layers", ())) != inner for g in stack):
        raise HeadsweepError(f"{type(loop).__name__} at {name or 'the model'} does not hold num_hidden_groups "
                             f"{groups} groups of inner_group_num {inner} layers: its applications cannot be numbered")
    order = []
    for i in range(layers):
        group = int(i / (layers / groups))  # as AlbertTransformer.forward picks it
        order += [f"{name}.albert_layer_groups.{group}.albert_layers.{j}.attention".lstrip(".") for j in range(inner)]
    seen: dict[str, int] = {}
    calls = []
    for module_name in order:
        calls.append(seen.get(module_name, 0))
        seen[module_name] = calls[-1] + 1
    return [Application(layer, module_name, call, seen[module_name])
            for layer, (module_name, call) in enumerate(zip(order, calls, strict=True))]


def applications(model: nn.Module) -> tuple[str, nn.Module, list[Application]] | None:
    """The looping module (its name, itself) and the attention applications of a model that runs layer modules
    at several depths, in the order it runs them; None for a model whose layers each run once."""
    for name, module in model.named_modules():
        if _is_albert_loop(module):
            return name, module, _albert_applications(name, module)
    return None


def application_sites(model: nn.Module) -> tuple[set[str], list[AttentionSite]]:
    """The attention modules the applications cover (by name) and one site per application; for a module called
    more than once per forward, call counters are installed on the model (once) and each site is bound to its call.
    Empty for a model whose layers each run once."""
    found = applications(model)
    if found is None:
        return set(), []
    _name, loop, apps = found
    shared = {a.module_name: (model.get_submodule(a.module_name), a.calls) for a in apps if a.calls > 1}
    counters = install_counters(loop, shared) if shared else {}
    sites = []
    for app in apps:
        module = model.get_submodule(app.module_name)
        layout = attention_layout(module)
        if layout is None:
            raise HeadsweepError(f"{app.module_name} ({type(module).__name__}) is not an attention layout headsweep "
                                 "describes: refused rather than gated by a guess")
        if layout.num_heads == 0:
            continue
        sites.append(AttentionSite(
            attention="self", layer=app.layer, num_heads=layout.num_heads, head_dim=layout.head_dim,
            out_proj=layout.out_proj, module=module, module_name=app.module_name, batch_dim=0,
            shared=SharedCall(counters[app.module_name], app.call) if app.calls > 1 else None))
    return {a.module_name for a in apps}, sites


def shared_modules(sites: list[AttentionSite]) -> dict[str, list[int]]:
    """Each shared module's name and the layers (applications) of its sites, in order; empty when none is shared."""
    out: dict[str, list[int]] = {}
    for site in sites:
        if site.shared is not None:
            out.setdefault(site.module_name, []).append(site.layer)
    return out


def shared_facts(sites: list[AttentionSite]) -> dict[str, dict[str, list[int]]]:
    """What ``runs.facts`` says of a model with shared modules (``shared_attention``: each module's applications,
    which the driver's checks read without torch); nothing for other models."""
    shared = shared_modules(sites)
    return {SHARED_ATTENTION: shared} if shared else {}


def refuse_shared(sites: list[AttentionSite], what: str) -> None:
    """One line refusing ``what`` (e.g. "physical pruning") for a model with a module shared by several
    applications (:func:`~headsweep.workers.core.shared_calls.shared_refusal`)."""
    shared = shared_modules(sites)
    if shared:
        raise HeadsweepError(f"{shared_refusal(what, shared)}; gate its heads without removing them")
