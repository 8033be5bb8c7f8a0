"""The terminal: the CLI, its console lines and progress display."""
