"""What the command-line tools print besides their own lines."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

from absl import flags, logging


def quiet_libraries(program: str | None = None) -> None:
    """Warnings and errors only from the libraries' loggers (orbax, absl, jax's backend
    probing: about 70 INFO lines a training run), which would bury the progress
    lines, unless ``--verbosity`` (absl's flag, e.g. ``--verbosity=0`` for INFO) was
    given; with ``program``, ndjax's own warnings are one line each (``one_line_warnings``).
    Call after the flags are parsed."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if program:
        one_line_warnings(program)


_NDJAX = os.path.dirname(os.path.abspath(__file__)) + os.sep


def one_line_warnings(program: str) -> None:
    """ndjax's warnings print as ``<program>: warning: <message>``, one line like its
    errors: Python's form (a location line, then the source line that warned) says
    nothing to a user. Other libraries' warnings keep Python's form, whose location is
    what their bug reports need."""
    default = warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
        if not os.path.abspath(filename).startswith(_NDJAX):
            return default(message, category, filename, lineno, line)
        return f"{program}: warning: {message}\n"

    warnings.formatwarning = formatted


# Lines the native libraries (XLA, jax's CUDA plugin) write straight to file
# descriptor 2, past Python's loggers, that say nothing to a user compiling for GPUs
# that are not here.
_NATIVE_NOISE = re.compile(
    r"Could not find cuda drivers|All log messages before absl::InitializeLog|"
    r"Unable to initialize backend|cudart_stub")
# What the SPMD partitioner says when it could not reshard a tensor efficiently:
# it gathers the whole tensor and partitions it again (time and memory).
_REMAT = re.compile(r"Involuntary full rematerialization.*")
# What XLA's GPU compiler says when the step needs more than the GPU's memory even
# after recomputing what it could.
_OVER = re.compile(r"Can't reduce memory use below.*")


@dataclasses.dataclass
class NativeOutput:
    """What native code wrote to stderr inside ``native_stderr``: the partitioner's
    involuntary rematerialisations and the GPU compiler's "can't reduce memory use"
    (one line each, de-duplicated), and the rest."""

    rematerializations: list[str] = dataclasses.field(default_factory=list)
    over_memory: list[str] = dataclasses.field(default_factory=list)
    other: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def native_stderr(echo: bool = True) -> Iterator[NativeOutput]:
    """Captures file descriptor 2 (where XLA's C++ logs go) for the block. Known noise
    is dropped, the partitioner's rematerialisation warnings are collected as
    findings, and anything else is written back to stderr afterwards (``echo``)."""
    out = NativeOutput()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            _sort(tmp.read().decode(errors="replace"), out)
            if echo and out.other:
                print("\n".join(out.other), file=sys.stderr, flush=True)


def _sort(text: str, out: NativeOutput) -> None:
    for line in text.splitlines():
        for pattern, found in ((_REMAT, out.rematerializations), (_OVER, out.over_memory)):
            match = pattern.search(line)
            if match:
                finding = " ".join(match.group(0).split())[:300]
                if finding not in found:
                    found.append(finding)
                break
        else:
            if line.strip() and not _NATIVE_NOISE.search(line):
                out.other.append(line)


def import_jax_quietly() -> None:
    """Imports jax with the native start-up lines of its CUDA plugin dropped: on a
    machine without a GPU driver (the gpu-compile extra compiles for GPUs from one)
    the plugin logs that it found none, which says nothing to the user. Call before
    anything else imports jax (a config file does)."""
    with native_stderr():
        import jax  # noqa: F401
