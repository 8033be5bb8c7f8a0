"""Statistics: significance tests and the per-run significance families (the pairs kind's interaction bootstrap
lives with the kind, ``headsweep.sweep.experiments.pairs.interactions``)."""
