"""A run's bookkeeping: the driver, the context the experiment kinds see, the chunks written, run records, budgets,
status and the screening policy."""
