"""Removing heads for real: the weight surgery behind export (the head slicing each family gives is
``headsweep.workers.core.head_slicing``, part of the family contract)."""
