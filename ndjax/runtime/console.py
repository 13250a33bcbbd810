"""What the command-line tools print besides their own lines."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pkgutil
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


# The package's root (this module is in ndjax/runtime/): ndjax's warnings come from
# anywhere under it.
_NDJAX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


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
def native_stderr(echo: bool = True, into: str | None = None) -> Iterator[NativeOutput]:
    """Captures file descriptor 2 (where XLA's C++ logs go) for the block. Known noise
    is dropped, the partitioner's rematerialisation warnings are collected as
    findings, and anything else is written back to stderr afterwards (``echo``).
    ``into``: a file to capture into, which another process can read if XLA aborts
    this one inside the block."""
    out = NativeOutput()
    sys.stderr.flush()
    saved = os.dup(2)
    with (open(into, "w+b") if into else tempfile.TemporaryFile(mode="w+b")) as tmp:
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


def start_jax_quietly() -> None:
    """``import_jax_quietly``, and on a machine without an NVIDIA GPU where jax's CUDA
    plugin is installed (the gpu-compile extra), the plugins loaded now, quietly.

    For the programs that run on the platform jax picks (train.py, ndjax generate,
    ndjax export); call it before anything imports jax. There, jax would load the
    plugin when it first makes a backend, and the plugin's check of the CUDA libraries
    fails without a driver: a 20-line traceback (jax 0.10; a warning in later jax) and
    another native line, before the program's first line, for a backend jax then
    skips anyway (it starts CUDA only where it sees an NVIDIA device file). That check
    is skipped on such a machine alone, and only when JAX_PLATFORMS chooses nothing: a
    machine with a GPU, or a run that asks for CUDA, loads the plugin when and as
    before, with every error it reports. The compile verbs choose the CPU platform
    themselves, which skips the check too (ndjax compile, ndjax plan).
    """
    import_jax_quietly()
    import jax

    try:  # private: where jax decides whether to start CUDA, and loads the plugins
        from jax._src import hardware_utils, xla_bridge

        gpu_visible = hardware_utils.has_visible_nvidia_gpu
        load_plugins = xla_bridge._discover_and_register_pjrt_plugins
    except (ImportError, AttributeError):  # another jax: its lines as they come
        return
    if gpu_visible() or not _cuda_plugin_installed():
        return
    skip = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"  # the plugin's own switch
    saved = os.environ.get(skip)
    if not jax.config.jax_platforms:
        os.environ[skip] = "1"
    try:
        with native_stderr():
            load_plugins()
    finally:  # for this start-up only, not inherited by the processes this one starts
        if saved is None:
            os.environ.pop(skip, None)
        else:
            os.environ[skip] = saved


def _cuda_plugin_installed() -> bool:
    spec = importlib.util.find_spec("jax_plugins")  # namespace package of jax's plugins
    return spec is not None and any(m.name.startswith("xla_cuda") for m in
                                    pkgutil.iter_modules(spec.submodule_search_locations))
