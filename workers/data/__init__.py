"""Evaluation data on the worker side: paired inputs, text files, data reports and example subsets."""
