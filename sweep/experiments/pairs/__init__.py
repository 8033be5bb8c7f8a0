"""The ``pairs`` kind: pairwise head interactions. The kind (``kind.py``), its settings (``settings.py``), its
table (``tables.py``), its statistic (``interactions.py``: the paired bootstrap over four evaluations) and its
report part (``report.py``)."""

from headsweep.sweep.experiments.pairs.kind import PAIRS

__all__ = ["PAIRS"]
