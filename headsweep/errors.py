"""The one exception type users see as a one-line error."""


class HeadsweepError(Exception):
    """A problem with the user's input or environment, reported as one line, exit code 2."""
