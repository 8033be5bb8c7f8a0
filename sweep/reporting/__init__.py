"""Reporting: the HTML report assembled from the kinds' parts, its plots and the explorer, and run comparisons."""
