"""ndjax: hybrid-parallel LLM training in JAX.

Importing ndjax first sets up a CPU-only process's memory allocator (``ndjax.runtime.cpu_malloc``):
it has to happen before jax or numpy start threads.

As a library (docs/library.md), for a Flax NNX model of your own whose parameters
carry logical axis names: ``ParallelismConfig`` and ``ContextParallelConfig``
(Accelerate's names for the mesh), ``shard_model`` and ``make_train_step``. They are
imported on first use, so that ``import ndjax`` itself still imports neither jax nor
numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

from ndjax.runtime import cpu_malloc as _cpu_malloc

_cpu_malloc.keep_freed_memory()

# name -> module that defines it (PEP 562: loaded by __getattr__ on first access).
_LAZY = {
    "ParallelismConfig": "ndjax.parallel.parallelism",
    "ContextParallelConfig": "ndjax.parallel.parallelism",
    "shard_model": "ndjax.step.shard",
    "make_train_step": "ndjax.step.shard",
    "TrainStep": "ndjax.step.shard",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
