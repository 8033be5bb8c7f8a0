"""Statistics: significance tests, the per-run significance families, pairwise interactions."""
