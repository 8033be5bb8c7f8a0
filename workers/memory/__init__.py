"""Memory on a worker: replayed prefixes, batch budgets, backward-pass memory and model sharing between actors."""
