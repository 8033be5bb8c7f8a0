"""What every worker runs on: the actor, its work items, the model-family contract and registry, head names,
gates and metrics."""
