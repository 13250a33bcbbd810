"""The one error type for bad user input."""


class ConfigError(ValueError):
    """A config or input that cannot work; the message names the field and a fix.

    train.py prints it as one line and exits non-zero, without a traceback.
    """
