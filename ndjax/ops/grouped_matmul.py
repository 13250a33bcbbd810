"""Grouped matmuls, the MoE experts' products: rows sorted by group, each group's run
of rows times that group's matrix, ``(M, K) x (G, K, N) -> (M, N)``.

Two implementations (``model.moe_impl``):

- ``xla``: ``jax.lax.ragged_dot``. CPUs and TPUs compute it as grouped; XLA's GPU
  compiler (jax 0.10) lowers it to a dense matmul over every group with masks, so
  its temporaries grow with the number of experts (compiled for H100s, 2 layers of
  Qwen3-30B-A3B at 8 x 4096 tokens: 55 GiB, tests/test_gpu_compile.py).
- ``mosaic``: jax's own Hopper kernels in Mosaic GPU (wgmma and TMA, persistent over
  the SMs): ``ragged_dot_mgpu`` for the product and for the rows' gradient (the
  matrices transposed), ``transposed_ragged_dot_mgpu`` for the matrices' gradient (the
  contraction over each group's rows), joined here by a custom VJP. NVIDIA Hopper
  (compute capability 9.x: H100, H200), bfloat16 or float16, K and N multiples of
  the blocks. On a CPU they run in Mosaic GPU's interpret mode (slowly: tests).

``auto`` picks ``mosaic`` where it can run and ``xla`` elsewhere (``choose``).
Both accumulate in float32 and round the product to the inputs' dtype.

The contract every implementation keeps (a new one too), forward and backward: the
rows past the groups (``sizes`` summing below M: capacity mode's dropped pairs, an
exchange buffer's unfilled rows, block padding) are never read, whatever they hold,
and come back as zeros, in the product and in the rows' gradient; an empty group's
weights' gradient is zero. ragged_dot keeps it by itself. jax's Mosaic kernels write
only the rows of their groups and read whole blocks of rows, so ``_mosaic`` zeroes
their outputs' tail and the contraction's inputs' tail (tests/test_grouped_matmul.py
checks it in the interpreter, which fills unwritten memory with NaN).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from ndjax.parallel import mesh as mesh_lib
from ndjax.parallel import platforms
from ndjax.parallel.rules import active
from ndjax.runtime.errors import ConfigError

IMPLS = ("auto", "xla", "mosaic")
# The contraction block (64 bfloat16 values: one 128-byte swizzle row) and the
# largest output blocks. Shared memory per SM: (M x K + K x N) x 2 bytes x 4 stages
# + an M x N output block = 160 KiB of Hopper's 227 KiB.
BLOCK_K = 64
BLOCK = 128
STAGES = 4
# How the kernels visit output tiles (jax's planar snake over N); 1: row by row.
GRID_BLOCK_N = 1
_DTYPES = ("bfloat16", "float16")
H100_SMS = 132  # where a compile target does not say
# Mosaic GPU's interpreter runs the weights' gradient kernel from jax 0.12 (0.10's has
# no layout_cast rule); before, XLA's contraction stands in for it on CPUs.
INTERPRETER_RUNS_CONTRACTION = jax.__version_info__ >= (0, 12)
# The SMs the persistent kernels spread over when interpreted (a CPU device has none):
# a few, so that the tests visit more than one SM's share of the tiles.
INTERPRETED_SMS = 4


@dataclasses.dataclass(frozen=True)
class Site:
    """Where the experts' matmuls run, as far as the choice depends on it."""

    platform: str                   # of the step's devices: cpu | gpu | tpu
    compute_capability: str | None  # of the first GPU, e.g. "9.0"
    dtype: str                      # the compute dtype's name
    dims: tuple[int, ...]           # the matrices' dims on one device: model dim, width
    stages: int = 1                 # mesh.stage: the layers vmapped over pipeline stages

    @classmethod
    def of(cls, cfg: Any, devices: Iterable[jax.Device], width_shards: int = 1,
           stages: int = 1) -> Site:
        """``cfg``: a ``DecoderConfig`` with experts; ``devices``: the step's;
        ``width_shards``: the ways the rules split each expert's width (tensor);
        ``stages``: the mesh's pipeline stages."""
        devices = list(devices)
        return cls(platform=platforms.of(devices),
                   compute_capability=platforms.compute_capability(devices),
                   dtype=jnp.dtype(cfg.dtype).name,
                   dims=(cfg.dim, cfg.expert_dim // max(1, width_shards)), stages=stages)


def _block(n: int) -> int | None:
    """The output block for a dimension of ``n``: the largest of 128 and 64 dividing it."""
    return next((b for b in (BLOCK, BLOCK_K) if n % b == 0), None)


def mosaic_refusal(site: Site) -> str | None:
    """Why the Mosaic GPU kernels cannot run at ``site`` (None: they can)."""
    if site.platform != "gpu":
        # (Interpreted on a CPU they run alone, in tests, but not inside the model: the
        # interpreter's callbacks cannot be rematerialised.)
        return (f"jax's Mosaic GPU grouped matmuls run on NVIDIA Hopper GPUs, and this step "
                f"is built for {site.platform.upper()}s")
    if not (site.compute_capability or "").startswith("9."):
        return (f"jax's Mosaic GPU grouped matmuls are written for Hopper GPUs (compute "
                f"capability 9.x: H100, H200), and this one is {site.compute_capability}")
    if site.stages > 1:
        # The pipeline vmaps the layers over the stages, and jax's batching of the
        # kernel fails (ragged_dot_mgpu takes the length of a batched ref).
        return (f"they cannot run inside pipeline stages (mesh.stage={site.stages}), where "
                "jax cannot batch them")
    if site.dtype not in _DTYPES:
        return f"they need bfloat16 or float16 compute, and model.dtype is {site.dtype}"
    bad = [d for d in site.dims if d % BLOCK_K]
    if bad:
        return (f"they work in blocks of {BLOCK_K}, and the experts' dims on one device "
                f"(model dim, width: {site.dims[0]}, {site.dims[1]}) are not both multiples "
                "of it")
    return None


def choose(impl: str, site: Site) -> str:
    """``xla`` or ``mosaic`` for ``model.moe_impl=impl``; ConfigError where an explicit
    choice cannot run. ``auto`` takes ``mosaic`` wherever it can run."""
    if impl not in IMPLS:
        raise ConfigError(f"model.moe_impl={impl!r}: choose one of {IMPLS} (auto: the Mosaic "
                          "GPU kernels on Hopper GPUs, else jax.lax.ragged_dot).")
    why = mosaic_refusal(site)
    if impl == "mosaic" and why:
        raise ConfigError(f"model.moe_impl='mosaic': {why}. Use model.moe_impl='xla'.")
    if impl == "auto":
        return "xla" if why else "mosaic"
    return impl


DESCRIPTIONS = {"xla": "jax.lax.ragged_dot (on GPUs: a dense matmul over every expert)",
                "mosaic": "jax's Mosaic GPU grouped matmuls for Hopper"}


def resolved(cfg: Any) -> str:
    """``cfg.moe_impl``, with ``auto`` chosen for the active mesh's devices (a model
    built outside an ``Experiment``, which resolves it up front)."""
    if cfg.moe_impl != "auto":
        return cfg.moe_impl
    rules = active()
    if rules is None:
        return choose("auto", Site.of(cfg, jax.devices()))
    return choose("auto", Site.of(cfg, rules.mesh.devices.flat, width_shards(rules),
                                  mesh_lib.stages(rules.mesh)))


def width_shards(rules: Any) -> int:
    """The ways ``rules`` split each expert's width."""
    return math.prod(rules.mesh.shape[a] for a in rules.axes_of("expert_mlp"))


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, impl: str = "xla"
                   ) -> jax.Array:
    """``x`` (M, K) rows sorted by group, ``w`` (G, K, N), ``sizes`` (G,) int32 rows per
    group (summing to M) -> (M, N) in ``x``'s dtype."""
    if impl == "xla":
        return jax.lax.ragged_dot(x, w, sizes)
    if impl != "mosaic":
        raise ValueError(f"grouped_matmul: impl={impl!r} is not 'xla' or 'mosaic'")
    return _mosaic(x, w, sizes.astype(jnp.int32))


def _default_device() -> jax.Device | None:
    from jax._src import config

    device = config.default_device.value  # ndjax.hardware.gpu_target.compiling_for sets it
    return device if isinstance(device, jax.Device) else None


def _interpreted() -> bool:
    """Whether the kernels run interpreted: a step built for CPUs (the active mesh's
    devices, else the default device's platform)."""
    if active() is None and _default_device() is not None:
        return _default_device().platform != "gpu"
    return platforms.current() != "gpu"


@contextlib.contextmanager
def _kernel_context() -> Iterator[None]:
    """Where the kernels are traced: on a GPU as they are; for CPUs in Mosaic GPU's
    interpret mode; for GPUs from a CPU process (``ndjax.hardware.gpu_target``) with
    ``jax.devices()`` answering the target GPU while they are traced, because
    ``transposed_ragged_dot_mgpu`` sizes its persistent grid from
    ``jax.devices()[0].core_count`` (the SMs), which a CPU device does not have."""
    if jax.default_backend() == "gpu":
        yield
        return
    if _interpreted():
        from jax._src.pallas.mosaic_gpu.interpret import params

        interpret, sms = params.force_gpu_interpret_mode(), INTERPRETED_SMS
    else:
        interpret = contextlib.nullcontext()
        sms = getattr(_default_device(), "core_count", None) or H100_SMS
    real = jax.devices
    jax.devices = lambda *a, **k: [types.SimpleNamespace(core_count=sms)]
    try:
        with interpret:
            yield
    finally:
        jax.devices = real


def _padded(x: jax.Array) -> jax.Array:
    """Rows padded to a multiple of the kernels' blocks (the padding in no group)."""
    pad = -x.shape[0] % BLOCK
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _in_groups(a: jax.Array, sizes: jax.Array) -> jax.Array:
    """``a`` with its rows past the groups zeroed, whatever they held (NaN included)."""
    inside = (jnp.arange(a.shape[0]) < jnp.sum(sizes))[:, None]
    return jnp.where(inside, a, jnp.zeros_like(a))


def _product(x, w, sizes, transpose: bool = False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    if transpose and _interpreted():
        # The interpreter has no transposed wgmma operand: the matrices transposed in
        # memory instead (on GPUs the kernel reads them transposed).
        w, transpose = jnp.swapaxes(w, 1, 2), False
    n = w.shape[1] if transpose else w.shape[2]
    with _kernel_context():
        out = ragged_dot_mgpu.ragged_dot(
            _padded(x), w, group_sizes=sizes, block_m=BLOCK, block_n=_block(n),
            block_k=BLOCK_K, max_concurrent_steps=STAGES, grid_block_n=GRID_BLOCK_N,
            transpose_rhs=transpose)
    # The kernel writes only its groups' rows: the padding and any row past the groups
    # hold whatever memory did.
    return _in_groups(out[:x.shape[0]], sizes)


def _contraction(x, dy, sizes):
    """Per group g, ``x[g's rows].T @ dy[g's rows]``: (M, K), (M, N) -> (G, K, N)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    k, n = x.shape[1], dy.shape[1]
    if _interpreted() and not INTERPRETER_RUNS_CONTRACTION:
        # jax 0.10's Mosaic GPU interpreter cannot run this kernel (no layout_cast):
        # XLA's contraction over each group's rows stands in for it there.
        return _reference_contraction(x, dy, sizes)
    # The kernel reads whole blocks of rows and masks the ones past a group by
    # multiplying: a NaN there (another kernel's unwritten row) would reach the
    # group's gradient.
    x, dy = _in_groups(x, sizes), _in_groups(dy, sizes)
    with _kernel_context():
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            _padded(x), _padded(dy), group_sizes=sizes, block_m=_block(k),
            block_n=_block(n), block_k=BLOCK_K, max_concurrent_steps=STAGES,
            grid_block_n=GRID_BLOCK_N)


def _reference_contraction(x, dy, sizes):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(x, dy, sizes, dims,
                                      preferred_element_type=jnp.float32).astype(x.dtype)


@jax.custom_vjp
def _mosaic(x, w, sizes):
    return _product(x, w, sizes)


def _mosaic_fwd(x, w, sizes):
    # The residuals are the inputs: under remat, rerunning them reruns what made the
    # rows (a gather), never the kernel.
    return _product(x, w, sizes), (x, w, sizes)


def _mosaic_bwd(res, dy):
    x, w, sizes = res
    dy = dy.astype(x.dtype)
    dx = _product(dy, w, sizes, transpose=True)  # zero past the groups, as the forward
    dw = _contraction(x, dy, sizes).astype(w.dtype)
    return dx, dw, None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)
