"""How a command meets its terminal: headsweep's own lines on the console (third-party output to the log file), the
progress display, and how Ctrl-C and SIGTERM end it. The bottom of ``sweep``: the CLI (``terminal/``), the run loop,
the kinds and the Ray session all use it."""
