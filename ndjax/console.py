"""What the command-line tools print besides their own lines."""

from __future__ import annotations

from absl import flags, logging


def quiet_libraries() -> None:
    """Warnings and errors only from the libraries' loggers (orbax, absl, jax's backend
    probing: about 70 INFO lines a training run), which would bury the progress
    lines, unless ``--verbosity`` (absl's flag, e.g. ``--verbosity=0`` for INFO) was
    given. Call after the flags are parsed."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
