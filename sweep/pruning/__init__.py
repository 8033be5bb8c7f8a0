"""Pruned models: pruning levels, masks chosen from stored runs, and exporting a pruned model."""
