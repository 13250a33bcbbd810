"""Keeps a CPU-only process's freed memory mapped, so that XLA's per-step temporaries
are not page-faulted in again on every step. ``import ndjax`` applies it.

* Every execution of a compiled step asks for its temporaries in large blocks
  (~270 MiB for the bench's 4-layer model) and frees them at the end. glibc's
  malloc serves blocks that large with a fresh ``mmap`` and returns them with
  ``munmap``, so every step page-faults them in again and the kernel zeroes them:
  ~0.1 s of system time per step on that model, one tenth of its work.
  ``mallopt`` here keeps freed memory in the process instead: one malloc arena, no
  ``mmap`` for large blocks, and no trimming of the heap. The process keeps its
  peak memory mapped, as a GPU's allocator keeps its pool.
* Why one arena, and why at import: a thread's first ``malloc`` ties it to an
  arena. Threads other than the main one get arenas whose heaps cannot hold a
  block that large, and glibc then ``mmap``\\s the block whatever ``M_MMAP_MAX``
  says. Once ``M_ARENA_MAX`` is 1, new threads share the main arena, but an arena
  made earlier stays in use and is handed on to later threads. Importing jax
  already starts a thread, so the settings must come before jax and numpy are
  imported: this module imports neither, and ``ndjax/__init__.py`` runs it first.
* ``NDJAX_CPU_MALLOC=default`` leaves glibc's settings alone; so do non-glibc
  systems and hosts with a GPU or TPU plugin (whose allocators are their own).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pkgutil
import platform

ENV = "NDJAX_CPU_MALLOC"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8

applied = False  # whether this process runs with the settings


def cpu_only(env: dict[str, str]) -> bool:
    """True when jax will run on CPU devices only, decided without importing jax."""
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms.strip():
        return {p.strip() for p in platforms.split(",") if p.strip()} <= {"cpu"}
    if importlib.util.find_spec("libtpu") is not None:
        return False
    spec = importlib.util.find_spec("jax_plugins")  # namespace package of the GPU plugins
    return spec is None or not any(pkgutil.iter_modules(spec.submodule_search_locations))


def keep_freed_memory(env: dict[str, str] | None = None) -> bool:
    """Applies the settings on CPU-only glibc hosts unless ``NDJAX_CPU_MALLOC=default``;
    returns whether this process runs with them."""
    global applied
    env = os.environ if env is None else env
    if env.get(ENV, "").strip().lower() == "default":
        return applied
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not cpu_only(env):
        return applied
    libc = ctypes.CDLL(None)
    applied = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))
    return applied
