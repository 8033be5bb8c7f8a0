"""What every worker runs on: the actor, its work items, the model-family contract, head names,
gates and metrics."""
