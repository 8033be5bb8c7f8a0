"""The Ray actor every worker is (:mod:`.eval_worker`) and the checks a run makes through it before it writes
anything (:mod:`.checks`): the top of the worker side, it loads a family's model through the registry, installs the
run's ablation fill and shares weights between actors."""
