"""Ablation methods on the worker side: what a gated-off head leaves behind (``sweep.ablation``).

Each method is one object registered by name (:mod:`.registry`: ``zero``, ``mean``, ``resample``, ``optimal``,
``patch``, and plugins in the ``headsweep.ablations`` entry-point group), one module each, declaring what the
pipeline asks of it and its own settings (a dataclass: the keys of the ``ablation`` section it reads; the contract:
:mod:`.method`). The machinery they share: the gate formula and the run's spec
(:mod:`.spec`), reference means (:mod:`.means`), per-example donors (:mod:`.donors`), optimal constants' training
(:mod:`.optimal`) and the worker's installed fill (:mod:`.worker_fill`). The driver's side is
``headsweep.sweep.ablation``.
"""
