"""Removing heads for real: the weight surgery behind export and the head slicing it uses."""
