"""``python -m headsweep``: the same as the ``headsweep`` command."""

from headsweep.sweep.terminal.cli import console_main

raise SystemExit(console_main())
