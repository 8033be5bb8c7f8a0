"""The driver's side of ablation methods (``sweep.ablation``): the workers' settings (:mod:`.values`'s
``ablation_spec``), constant fills fetched from the workers or trained on them and stored in ``ablation_values``
(:mod:`.fill`, :mod:`.values`, :mod:`.training`). What each method is lives in ``headsweep.workers.ablation``;
this package asks it what it declares, never its name."""
