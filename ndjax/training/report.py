"""Human-readable sharding table: where every parameter lives and what it costs."""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding

from ndjax.experiment import Experiment


def _bytes_per_device(shape: tuple[int, ...], itemsize: int, sharding: NamedSharding) -> int:
    return math.prod(sharding.shard_shape(shape)) * itemsize


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def sharding_table(exp: Experiment, compile_step: bool = True) -> str:
    """One row per parameter: path, shape, dtype, logical names, PartitionSpec,
    bytes/device; then totals of parameters and optimizer state, with their dtypes
    (model.param_dtype, train.opt_state_dtype)."""
    leaves = jax.tree_util.tree_flatten_with_path(exp.param_shapes)[0]
    names = jax.tree.leaves(exp.param_names, is_leaf=lambda x: isinstance(x, tuple))
    shardings = jax.tree.leaves(exp.state_sharding.params)
    rows = [("parameter", "shape", "dtype", "logical axes", "PartitionSpec", "bytes/device")]
    total = per_device = 0
    for (path, shape), logical, sharding in zip(leaves, names, shardings):
        nbytes = math.prod(shape.shape) * shape.dtype.itemsize
        local = _bytes_per_device(shape.shape, shape.dtype.itemsize, sharding)
        total += nbytes
        per_device += local
        rows.append(("/".join(str(k.key) for k in path), str(shape.shape), str(shape.dtype),
                     ", ".join(str(n) for n in logical), str(tuple(sharding.spec)),
                     format_bytes(local)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"mesh: {exp.dims}  ({exp.mesh.devices.size} devices)",
             "rules:", *(f"  {n:<14} -> {a}" for n, a in exp.rules.table), ""]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    opt_leaves = list(zip(jax.tree.leaves(exp.abstract_state.opt_state),
                          jax.tree.leaves(exp.state_sharding.opt_state)))
    opt_local = sum(_bytes_per_device(s.shape, s.dtype.itemsize, sh) for s, sh in opt_leaves)

    def dtypes(shapes) -> str:
        return ", ".join(sorted({str(s.dtype) for s in shapes if s.ndim}))

    lines.append("")
    lines.append(f"parameters: {format_bytes(total)} in all, {format_bytes(per_device)} per device "
                 f"({dtypes(s for _, s in leaves)})")
    lines.append(f"optimizer state: {format_bytes(opt_local)} per device "
                 f"(moments {dtypes(s for s, _ in opt_leaves)})")
    if compile_step:
        # Activations, gradients and collective buffers of one step, as XLA planned them.
        temp = exp.compiled_step.memory_analysis().temp_size_in_bytes
        lines.append(f"step temporaries (compiled): {format_bytes(temp)} per device")
    return "\n".join(lines)
