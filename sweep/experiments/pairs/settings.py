"""The ``pairs`` config section: which heads' pairwise interactions a run measures."""

from __future__ import annotations

from dataclasses import dataclass

from headsweep.errors import HeadsweepError
from headsweep.workers.core.setting_ranges import check_ranges, ranged

PAIR_SELECTS = ("all", "importance", "single_head", "list")
PAIR_SCOPES = ("all", "layer")


@dataclass
class PairsSection:
    """The ``pairs`` experiment: pairwise head interactions (``headsweep.sweep.experiments.pairs``).

    ``select`` picks the heads: ``all`` (every head of ``sweep.attention``), the ``top_k`` heads ranked
    by ``importance`` (the run's importance scores) or by ``single_head`` |delta| (of this run, or of
    ``from_run``), or ``list`` (``heads``, head names). ``scope``: ``all`` pairs among them, or only
    pairs within one ``layer``. More than ``max_pairs`` pairs is refused before anything runs.
    """

    select: str = "all"
    top_k: int = ranged(10, at_least=2, why=" (a pair needs two heads)")
    scope: str = "all"
    heads: list[str] | None = None
    from_run: str | None = None
    max_pairs: int = ranged(500, at_least=1)

    def check(self) -> None:
        if self.select not in PAIR_SELECTS:
            raise HeadsweepError(f"unknown pairs.select {self.select!r} (known: {', '.join(PAIR_SELECTS)})")
        if self.scope not in PAIR_SCOPES:
            raise HeadsweepError(f"unknown pairs.scope {self.scope!r} (known: {', '.join(PAIR_SCOPES)})")
        check_ranges(self, "pairs")
        if self.select == "list" and len(set(self.heads or [])) < 2:
            raise HeadsweepError("pairs.select list needs pairs.heads: at least two head names (attention:layer:head)")
        if self.select != "list" and self.heads:
            raise HeadsweepError(f"pairs.heads is read with pairs.select list, not {self.select}")
        if self.from_run and self.select not in ("importance", "single_head"):
            raise HeadsweepError(f"pairs.from_run ranks heads for pairs.select importance or single_head, "
                                 f"not {self.select}")
