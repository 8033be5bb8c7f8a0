"""Reporting: the HTML report, its figures, and run comparisons."""
