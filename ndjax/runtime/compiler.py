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

On CPUs one option keeps remat working on unrolled layers:

* ``xla_disable_hlo_passes=cse_barrier_expander``: jax keeps a checkpointed layer's
  recomputation apart from its forward pass with an optimization barrier; XLA's CPU
  pipeline removes the barriers (that pass) and then runs CSE again, which merged
  each unrolled layer's recomputation back into the forward: remat=full compiled to
  remat=none's memory (the tiny job of issue 33, 439 MiB both; a scanned layer's
  recomputation sits in another loop, out of CSE's reach). Left in, the barriers
  compile to nothing (with them, that job's full remat needs 143 MiB and none 262,
  as scanned). The GPU compiler keeps them until after its last CSE (unrolled
  layers' remat already held there) and cannot compile one left in, so it gets no
  such option. Tested: tests/test_memory_and_hlo.py.

The process's memory allocator on a CPU-only host is set up by ``ndjax.runtime.cpu_malloc``
when ndjax is imported; XLA's other CPU options are left at their defaults
(``bench/cpu_vs_torch.py`` measured the candidates: see BENCHMARKS.md).

The state's init runs once, so on a CPU it is compiled for compile time rather than
run time when the model is small (``init_options``): ``bench/first_step.py``.
"""

from __future__ import annotations

import os
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
CPU_OPTIONS: dict[str, Any] = {"xla_disable_hlo_passes": "cse_barrier_expander"}
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
    xla_flags = env.get("XLA_FLAGS", "")
    if platform == "cpu":
        return {k: v for k, v in CPU_OPTIONS.items() if f"--{k}=" not in xla_flags}
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
    return {k: v for k, v in chosen.items() if f"--{k}=" not in xla_flags}


# LLVM's optimisations off (as the planner measures: ndjax.planning.planner.MEASURE_OPTIONS)
# and, where this XLA still has them (jax 0.10's; jax 0.12's has not), the CPU backend's
# elemental emitters instead of its MLIR fusion emitters: the same HLO and buffers, the
# code of each fusion written another way, in two thirds of the compile time.
CPU_QUICK_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0,
                                     "xla_llvm_disable_expensive_passes": True,
                                     "xla_cpu_use_fusion_emitters": False}
# Options a newer XLA retired with what they chose between: dropped without a warning.
_RETIRED = frozenset({"xla_cpu_use_fusion_emitters"})
# Below this many parameters the init compiles quickly rather than runs quickly. Its
# compile time hardly depends on the model's size, its run time grows with it: for
# the 6M-parameter model of bench/first_step.py the quick options compile the init
# in ~1 s instead of ~5-7 s and run it in ~0.4 s instead of ~0.1 s (2 shared cores),
# so they stop paying at roughly 100M parameters.
CPU_QUICK_INIT_MAX_PARAMS = 50_000_000


def init_options(platform: str, n_params: int) -> dict[str, Any]:
    """Compile options of the state's init (random parameters, zero moments): on a
    CPU, for a small model, ``CPU_QUICK_OPTIONS``. The random numbers are the same
    bits (threefry is integer arithmetic); the float transforms of them (normal,
    truncated normal) may round differently in the last bit, ~4% of values by
    1 ulp, which is no model's concern. Elsewhere: XLA's defaults (the step's
    overlap options would schedule collectives an init does not have)."""
    if platform == "cpu" and n_params <= CPU_QUICK_INIT_MAX_PARAMS:
        return dict(CPU_QUICK_OPTIONS)
    return {}


def compile_step(lowered: jax.stages.Lowered,
                 compiler_options: dict[str, Any] | None = None,
                 platform: str | None = None) -> jax.stages.Compiled:
    """``lowered.compile`` with ``options(platform)``, dropping (with a warning) any
    option this XLA does not know."""
    chosen = options(platform) if compiler_options is None else dict(compiler_options)
    for name in _REFUSED & chosen.keys():
        _drop(chosen, name)
    while True:
        try:
            return lowered.compile(compiler_options=chosen or None)
        except Exception as e:  # noqa: BLE001 -- jaxlib's error type moves between releases
            unknown = _UNKNOWN.search(str(e))
            if not unknown or unknown.group(1) not in chosen:
                raise
            _REFUSED.add(unknown.group(1))
            _drop(chosen, unknown.group(1))


# Options this process's XLA refused, not offered again: each refusal costs a failed
# compile call (0.13 s for the tiny step on jax 0.12), and the planner compiles hundreds.
_REFUSED: set[str] = set()


def _drop(chosen: dict[str, Any], name: str) -> None:
    if name not in _RETIRED:
        warnings.warn(f"XLA does not know the compile option {name!r} "
                      f"(ndjax.runtime.compiler); compiling without it.", stacklevel=3)
    del chosen[name]
