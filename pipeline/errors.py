"""The one exception type that reaches users as a one-line message."""


class UserError(Exception):
    """Bad input, bad configuration or a refused operation.

    The CLI prints ``error: <message>`` on one line and exits with status 2; the
    message must say what is wrong and what to do about it.
    """
