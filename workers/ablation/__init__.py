"""Ablation methods on the worker side: the method spec, stored means, donors, optimal constants and the
per-example fill."""
