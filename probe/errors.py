"""Errors caused by what a user asked for: the CLI prints them as one line, without a traceback."""


class ProbeError(Exception):
    """A user's mistake or an unavailable resource, with a message that says what to do."""
