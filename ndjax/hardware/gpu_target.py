"""Compiling for NVIDIA GPUs on a machine without one.

XLA's GPU compiler runs without a GPU when it is told what the GPU is: jax's CUDA
plugin makes compile-only devices from a *topology* (nodes x GPUs per node) and a
``GpuTargetConfigProto`` describing one GPU. ``devices(hw, n, per_node)`` builds
them from ``ndjax.hardware.roofline.HARDWARE``, the one table of each GPU's figures, and
``Experiment.from_config(config, devices)`` then lowers and compiles the real
train step for them: the GPU's own buffer assignment, kernels (cuDNN custom
calls, Pallas/Triton), collectives and compiler options. Nothing runs.

What it cannot see (docs/compile-and-plan.md, "Compiling for GPUs you don't have"):
nothing is autotuned (GEMMs get default tilings), cuDNN builds no graph, so neither
cuBLAS nor cuDNN workspaces are in the memory figures; and there is no speed.

Two places in jax ask the *default* backend (the CPU here) about the GPU:
``jax._src.cudnn.fused_attention_stablehlo`` decides cuDNN's Hopper features from
the first local GPU's compute capability, and Pallas's Triton lowering reads the
default device's kind. ``compiling_for`` answers both for the target while a step
is traced and compiled.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from ndjax.hardware.roofline import HARDWARE, Hardware
from ndjax.runtime.errors import ConfigError

# What compiling for a GPU needs on a CPU machine, beyond ndjax's own install: the
# CUDA plugin of this jax (compile-only devices), ptxas (nvcc) and cuDNN.
INSTALL = "pip install -e '.[gpu-compile]'"
_PIECES = (("jax_plugins.xla_cuda12", "jax's CUDA 12 plugin (jax[cuda12-local])"),
           ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12 (ptxas)"),
           ("nvidia.cudnn", "nvidia-cudnn-cu12"))
# Used when the installed cuDNN cannot be asked (it decides which fused attention
# jax lowers); jax's CUDA 12 wheels need at least 9.8.
DEFAULT_CUDNN = (9, 8, 0)


def missing() -> list[str]:
    """The pieces of the ``gpu-compile`` extra that are not installed."""
    out = []
    for module, what in _PIECES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(what)
    return out


def require() -> None:
    """ConfigError (one line, with the install command) unless the extra is installed."""
    absent = missing()
    if absent:
        raise ConfigError(
            f"compiling for a GPU on this machine needs the gpu-compile extra (not installed: "
            f"{', '.join(absent)}). Install it with: {INSTALL}")


def hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ConfigError(f"--hardware={name!r}: choose one of {sorted(HARDWARE)}.")
    return HARDWARE[name]


def _cudnn_version() -> tuple[int, int, int]:
    try:
        from jax._src.lib import cuda_versions

        v = cuda_versions.cudnn_get_version()  # e.g. 92800
        return v // 10000, v // 100 % 100, v % 100
    except Exception:  # noqa: BLE001 -- no cuDNN to ask: jax's own floor
        return DEFAULT_CUDNN


def target_config(hw: Hardware) -> str:
    """``hw`` as a ``GpuTargetConfigProto`` in text form (the fields XLA reads to
    compile: compute capability, limits of a block and an SM, memory, cuDNN)."""
    c = hw.chip
    major, minor = hw.compute_capability.split(".")
    cudnn = _cudnn_version()
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": 48 * 1024,
        "shared_memory_per_core": c.smem_per_sm_kb * 1024,
        "shared_memory_per_block_optin": c.smem_per_block_optin_kb * 1024,
        "threads_per_core_limit": 2048, "core_count": c.sms, "fpus_per_core": c.fp32_per_sm,
        "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": int(c.hbm_tbs * 1e12), "l2_cache_size": c.l2_mb * 2**20,
        "clock_rate_ghz": c.clock_ghz, "device_memory_size": int(hw.memory_bytes),
        "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
              'platform_name: "CUDA"',
              f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}",
              f'device_description_str: "{c.device_name}"']
    return "\n".join(lines) + "\n"


def devices(hw: Hardware, n: int, per_node: int = 8) -> list[jax.Device]:
    """``n`` compile-only GPUs of kind ``hw``, ``per_node`` to a node (in jax's
    order: a node's GPUs are neighbours, as ``ndjax.parallel.mesh.build_mesh`` expects)."""
    require()
    if n < 1 or per_node < 1:
        raise ConfigError(f"--devices={n} and --devices_per_node={per_node} must be >= 1.")
    nodes, in_node = (n // per_node, per_node) if n > per_node else (1, n)
    if nodes * in_node != n:
        raise ConfigError(f"--devices={n} is not a whole number of nodes of "
                          f"--devices_per_node={per_node}. Use a multiple of {per_node}.")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", topology=f"1x{nodes}x{in_node}", target_config=target_config(hw))
    return list(topology.devices)


@contextlib.contextmanager
def compiling_for(target: Sequence[jax.Device]) -> Iterator[None]:
    """Trace and compile for ``target``'s GPUs from a CPU process: jax's cuDNN checks
    get the target's compute capability, and the target is the default device (what
    Pallas's lowering asks). A no-op for devices of the running backend."""
    first = target[0]
    if first.platform != "gpu" or jax.default_backend() == "gpu":
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    capability = tuple(int(x) for x in first.compute_capability.split("."))

    def at_least(wanted: str) -> bool:
        return capability >= tuple(int(x) for x in wanted.split("."))

    def equal(wanted: str) -> bool:
        return capability == tuple(int(x) for x in wanted.split("."))

    saved: dict[str, Any] = {name: getattr(cudnn, name) for name in
                             ("check_compute_capability", "is_cuda_compute_capability_equal")}
    cudnn.check_compute_capability = at_least
    cudnn.is_cuda_compute_capability_equal = equal
    try:
        with jax.default_device(first):
            yield
    finally:
        for name, fn in saved.items():
            setattr(cudnn, name, fn)
