"""The sweep driver: configuration, planning, scheduling on Ray, statistics and the CLI."""
