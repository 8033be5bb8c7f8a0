"""Head names: ``attention:layer:head``, counted from 0, as the results tables store them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import total_ordering

from headsweep.errors import HeadsweepError

ENCODER_DECODER_TYPES = ("enc_self", "enc_dec", "dec_self")
SINGLE_STACK_TYPES = ("self",)
ATTENTION_TYPES = ENCODER_DECODER_TYPES + SINGLE_STACK_TYPES

SiteKey = tuple[str, int]  # (attention, layer): one attention module


def attention_rank(attention: str) -> int:
    """Position of an attention type in ``ATTENTION_TYPES`` (unknown types after the known ones)."""
    return ATTENTION_TYPES.index(attention) if attention in ATTENTION_TYPES else len(ATTENTION_TYPES)


def site_order(key: SiteKey) -> tuple[int, str, int]:
    """Sort key of an ``(attention, layer)`` pair, in the order heads sort."""
    return (attention_rank(key[0]), key[0], key[1])


@total_ordering
@dataclass(frozen=True)
class Head:
    """One attention head of one attention type in one layer.

    Heads sort in model order, the one order used everywhere (inventories, masks, rankings,
    eval ids of custom masks): attention type as listed in ``ATTENTION_TYPES`` (``enc_self``,
    ``enc_dec``, ``dec_self``, ``self``; not alphabetically), then layer, then head.
    """

    attention: str
    layer: int
    head: int

    def __str__(self) -> str:
        return f"{self.attention}:{self.layer}:{self.head}"

    @property
    def site(self) -> SiteKey:
        """The ``(attention, layer)`` of the module this head belongs to."""
        return (self.attention, self.layer)

    def sort_key(self) -> tuple[int, str, int, int]:
        return (*site_order(self.site), self.head)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Head):
            return NotImplemented
        return self.sort_key() < other.sort_key()

    @classmethod
    def parse(cls, text: str) -> Head:
        """Parse ``attention:layer:head`` (e.g. ``enc_self:0:3``)."""
        parts = text.strip().split(":")
        if len(parts) != 3 or parts[0] not in ATTENTION_TYPES:
            raise HeadsweepError(
                f"bad head name {text!r}: expected attention:layer:head with attention one of "
                f"{', '.join(ATTENTION_TYPES)} (e.g. self:0:3)"
            )
        try:
            layer, head = int(parts[1]), int(parts[2])
        except ValueError:
            raise HeadsweepError(f"bad head name {text!r}: layer and head must be integers") from None
        return cls(parts[0], layer, head)


@dataclass(frozen=True)
class LayerShape:
    """The heads of one attention module: its type, layer index and head count."""

    attention: str
    layer: int
    num_heads: int

    def heads(self) -> list[Head]:
        return [Head(self.attention, self.layer, h) for h in range(self.num_heads)]


class HeadInventory:
    """Every head of a model, in a stable order (attention type, layer, head)."""

    def __init__(self, layers: list[LayerShape]):
        self.layers = sorted(layers, key=lambda s: site_order((s.attention, s.layer)))
        self._by_key = {(s.attention, s.layer): s for s in self.layers}

    @property
    def heads(self) -> list[Head]:
        return [h for s in self.layers for h in s.heads()]

    @property
    def attention_types(self) -> list[str]:
        return list(dict.fromkeys(s.attention for s in self.layers))

    def layer(self, attention: str, layer: int) -> LayerShape:
        return self._by_key[(attention, layer)]

    def check(self, head: Head) -> Head:
        """Raise a clear error unless ``head`` exists in this model."""
        if head.attention not in self.attention_types:
            raise HeadsweepError(
                f"head {head}: this model has no {head.attention!r} attention "
                f"(it has {', '.join(self.attention_types)})"
            )
        shape = self._by_key.get((head.attention, head.layer))
        if shape is None:
            numbers = [s.layer for s in self.layers if s.attention == head.attention]
            n = len(numbers)
            if numbers != list(range(n)):
                # A hybrid model (state-space or recurrent layers between attention layers), or one pruned to no
                # heads in some layer: say which layers have heads.
                raise HeadsweepError(
                    f"head {head}: layer {head.layer} has no {head.attention} attention heads (this model's "
                    f"{head.attention} attention is in layers {_numbers(numbers)})"
                )
            raise HeadsweepError(
                f"head {head}: layer {head.layer} out of range ({head.attention} has {n} layers, 0..{n - 1})"
            )
        if not 0 <= head.head < shape.num_heads:
            raise HeadsweepError(
                f"head {head}: head {head.head} out of range ({head.attention} layer {head.layer} has "
                f"{shape.num_heads} heads, 0..{shape.num_heads - 1})"
            )
        return head

    def to_json(self) -> list[dict]:
        return [{"attention": s.attention, "layer": s.layer, "num_heads": s.num_heads} for s in self.layers]

    @classmethod
    def from_json(cls, rows: list[dict]) -> HeadInventory:
        return cls([LayerShape(r["attention"], int(r["layer"]), int(r["num_heads"])) for r in rows])


def heads_by_site(heads: Iterable[Head], inventory: HeadInventory | None = None) -> dict[SiteKey, list[int]]:
    """Head numbers grouped by ``(attention, layer)``, ascending and without repeats.

    With ``inventory`` every head is checked against it first (a clear error for a head the
    model does not have). Sites come in the order of their first head in ``heads``.
    """
    grouped: dict[SiteKey, set[int]] = {}
    for head in heads:
        if inventory is not None:
            inventory.check(head)
        grouped.setdefault(head.site, set()).add(head.head)
    return {key: sorted(numbers) for key, numbers in grouped.items()}


def _numbers(numbers: list[int], shown: int = 12) -> str:
    text = ", ".join(map(str, numbers[:shown]))
    return text + (f" (+{len(numbers) - shown} more)" if len(numbers) > shown else "")
