"""The terminal: the CLI (what it prints and how it ends on a signal is ``headsweep.sweep.output``)."""
