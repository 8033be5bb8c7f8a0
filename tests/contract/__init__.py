"""The family contract suite: the same checks over every model family (see cases.py)."""
