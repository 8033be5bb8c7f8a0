"""``python -m headsweep``: the same as the ``headsweep`` command."""

from headsweep.sweep.terminal.cli import main

raise SystemExit(main())
