"""XLA options for compiling the train and eval steps, in one place.

On GPUs the step gets options that let XLA overlap communication with compute:

* ``xla_gpu_enable_latency_hiding_scheduler``: schedule each collective's start
  early and its wait late, so FSDP's all-gathers and reduce-scatters (and TP's
  all-reduces) run under the matmuls of the neighbouring layers;
* ``xla_gpu_enable_while_loop_double_buffering``: unroll the layer scan by two
  so that the next layer's weight all-gather can start inside this one;
* ``xla_gpu_{all_gather,reduce_scatter,all_reduce}_combine_threshold_bytes``:
  merge the many small collectives of one layer (one per weight) into a few
  large ones; 128 MiB holds every weight of a Llama 3 8B layer (436 MiB in
  bfloat16 over 4 or more FSDP shards) and of smaller models.

These are the options the JAX GPU performance guides and MaxText's GPU configs
recommend; their effect on ndjax's step is measured by ``bench/gpu.py``.

Overrides, from the environment:

* ``NDJAX_XLA_GPU_OPTIONS="name=value,..."`` adds or replaces options;
  ``NDJAX_XLA_GPU_OPTIONS=none`` turns them all off;
* an option also named in ``XLA_FLAGS`` is left to ``XLA_FLAGS``.

An option that this jaxlib no longer knows is dropped with a warning rather
than failing the run: XLA renames and retires its flags between releases.

On a CPU-only host, ``cpu_runtime_defaults()`` (called by
``ndjax.distributed.initialize`` before jax starts its backend) sets up the
process's memory allocator; XLA's own CPU options are left at their defaults
(``bench/cpu_vs_torch.py`` measured the candidates: see BENCHMARKS.md).

* Every execution of a compiled step asks for its temporaries in one block
  (~270 MiB for the bench's 4-layer model) and frees it at the end. glibc's
  malloc serves blocks that large with a fresh ``mmap`` and returns them with
  ``munmap``, so every step page-faults the whole block in again and the kernel
  zeroes it: ~0.1 s of system time per step on that model, one tenth of its
  work. ``mallopt`` here keeps freed memory in the process instead: one malloc
  arena (XLA's worker threads would otherwise get arenas whose heaps cannot hold
  a block that large, and those fall back to ``mmap``), no ``mmap`` for large
  blocks, and no trimming of the heap. The process keeps its peak memory
  mapped, as a GPU's allocator keeps its pool.
* ``NDJAX_CPU_MALLOC=default`` leaves glibc's settings alone; so do non-glibc
  systems and hosts with a GPU or TPU plugin.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import re
import warnings
from typing import Any

import jax

GPU_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 128 * 2**20,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 128 * 2**20,
    "xla_gpu_all_reduce_combine_threshold_bytes": 128 * 2**20,
}
ENV = "NDJAX_XLA_GPU_OPTIONS"
_UNKNOWN = re.compile(r"No such compile option: '([\w.]+)'")


def _parse(value: str) -> Any:
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(value)
    except ValueError:
        return value.strip()


def options(platform: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compile options for ``platform`` (default: jax's backend) under ``env``."""
    env = os.environ if env is None else env
    platform = jax.default_backend() if platform is None else platform
    if platform != "gpu":
        return {}
    override = env.get(ENV, "").strip()
    if override.lower() == "none":
        return {}
    chosen = dict(GPU_OPTIONS)
    for item in filter(None, (part.strip() for part in override.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}={override!r}: expected name=value pairs separated by "
                             "commas, or none.")
        chosen[name.strip().removeprefix("--")] = _parse(value)
    xla_flags = env.get("XLA_FLAGS", "")
    return {k: v for k, v in chosen.items() if f"--{k}=" not in xla_flags}


def compile_step(lowered: jax.stages.Lowered,
                 compiler_options: dict[str, Any] | None = None,
                 platform: str | None = None) -> jax.stages.Compiled:
    """``lowered.compile`` with ``options(platform)``, dropping (with a warning) any
    option this XLA does not know."""
    chosen = options(platform) if compiler_options is None else dict(compiler_options)
    while True:
        try:
            return lowered.compile(compiler_options=chosen or None)
        except Exception as e:  # noqa: BLE001 -- jaxlib's error type moves between releases
            unknown = _UNKNOWN.search(str(e))
            if not unknown or unknown.group(1) not in chosen:
                raise
            warnings.warn(f"XLA does not know the compile option {unknown.group(1)!r} "
                          f"(ndjax.compiler); compiling without it.", stacklevel=2)
            del chosen[unknown.group(1)]


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
MALLOC_ENV = "NDJAX_CPU_MALLOC"


def _cpu_only() -> bool:
    """True when jax will run on CPU devices only, decided without starting a backend."""
    platforms = jax.config.jax_platforms
    if platforms:
        return {p.strip() for p in platforms.split(",") if p.strip()} <= {"cpu"}
    if importlib.util.find_spec("libtpu") is not None:
        return False
    try:
        import jax_plugins  # namespace package of the GPU plugins
    except ImportError:
        return True
    import pkgutil
    return not any(pkgutil.iter_modules(jax_plugins.__path__))


def cpu_runtime_defaults(env: dict[str, str] | None = None) -> bool:
    """Keeps freed memory in the process on CPU-only glibc hosts (see the module's
    docstring); returns whether it did. Call before jax starts its backend: a thread
    that has already used another malloc arena keeps it."""
    env = os.environ if env is None else env
    if env.get(MALLOC_ENV, "").strip().lower() == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not _cpu_only():
        return False
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))
