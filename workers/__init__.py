"""Ray actors and the model/metric adapters that run on the GPUs (or CPUs) of a sweep."""
