"""A run's bookkeeping: the driver, the context the experiment kinds see, the chunks written, run records, budgets,
status, the hub ids a run pins and the screening policy."""
