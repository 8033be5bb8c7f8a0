"""What every worker runs on: its work items, the model-family contract, head names, gates and the gate arithmetic,
head slicing and metrics."""
