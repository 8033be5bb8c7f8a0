"""The ``importance`` kind (Michel et al. sec. 4.1): the kind (``kind.py``), its settings, its table, its
worker-side code; the estimates are ``headsweep.workers.analyses.importance`` and ``headsweep.workers.analyses.lrp``."""

from headsweep.sweep.experiments.importance.kind import IMPORTANCE, SHARED_KEY, importance_data

__all__ = ["IMPORTANCE", "SHARED_KEY", "importance_data"]
