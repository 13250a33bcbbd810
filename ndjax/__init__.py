"""ndjax: hybrid-parallel LLM training in JAX.

Importing ndjax first sets up a CPU-only process's memory allocator (``ndjax.cpu_malloc``):
it has to happen before jax or numpy start threads.
"""

from ndjax import cpu_malloc as _cpu_malloc

_cpu_malloc.keep_freed_memory()
