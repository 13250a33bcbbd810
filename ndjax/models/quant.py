"""A frozen base stored quantized, for QLoRA (Dettmers et al. 2023): int8, or 4-bit
NormalFloat (NF4), each block of ``block`` consecutive values scaled by its own absmax.

NF4's 16 levels are quantiles of a standard normal, rescaled to [-1, 1] with an exact
zero (QLoRA's section 3; bitsandbytes' ``create_normal_map(offset=0.9677083)``), so
normally distributed weights use every level about equally. A value is stored as the
level nearest to ``value / absmax(block)``; it reads back as ``level * absmax``. int8 is
``round(127 * value / absmax)``, read back as ``code * (absmax x float32(1/127))``.

Blocks run along a weight's last axis (the output features: ``(dim, heads, head_dim)``
blocks along head_dim, ``(ffn, dim)`` along dim), so that a block never straddles two
shards of a weight sharded as its rules say, and the codes and scales keep the weight's
logical names (the scales' last axis unsplit): the rule tables lay them out, and FSDP
gathers them, like the weight, moving a quarter of bfloat16's bytes under NF4. NF4 codes
are packed two to a byte along that axis, the first in the high nibble (bitsandbytes'
order). The scales are
float32 (QLoRA's second quantisation of the scales, 8-bit per 256, is not done here).

Weights are dequantised where a layer uses them, inside the layer scan, into the
compute dtype: device memory holds the codes, and one layer's weights at a time in the
compute dtype (as for any gathered weight). ``quantize`` and ``dequantize`` take numpy
arrays (the import quantises each shard on the host as it is read) or jax arrays alike.
Written here rather than taken from qwix, whose QLoRA mode intercepts a model's einsums:
the codes must be parameters with logical names for the rule tables, quantized by numpy
on import, in bitsandbytes' exact table and nibble order (docs/lora.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

KINDS = ("int8", "nf4")

# bitsandbytes' NF4 levels (float32), which are QLoRA's: the 8 positive and 7 negative
# quantiles of N(0, 1) at offset 0.9677083, and zero, each divided by the largest.
# tests/test_quant.py derives them from the normal distribution and checks every bit.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
# A value goes to the level whose interval between midpoints holds it.
_NF4_MIDPOINTS = ((NF4[1:] + NF4[:-1]) / 2).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    kind: str   # a key of KINDS
    block: int  # values per absmax scale, along the weight's last axis

    def shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(codes' shape, scales' shape) of a weight of ``shape``."""
        *lead, last = shape
        codes = last // 2 if self.kind == "nf4" else last
        return (*lead, codes), (*lead, last // self.block)

    def problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of ``shape`` cannot be quantized so (None: it can)."""
        if shape[-1] % self.block:
            return f"its last dimension, {shape[-1]}, is not a multiple of {self.block}"
        if self.kind == "nf4" and self.block % 2:
            return f"NF4 packs two codes a byte, and a block of {self.block} is odd"
        return None


def _xp(x: Any):
    return np if isinstance(x, np.ndarray) else jnp


def _blocks(x: Any, block: int) -> Any:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def quantize(w: Any, q: QuantConfig) -> tuple[Any, Any]:
    """``w`` -> (codes, a float32 scale per block): NF4 codes uint8 (two a byte) and the
    block's absmax, int8 codes int8 and absmax / 127; numpy in, numpy out."""
    xp = _xp(w)
    x = _blocks(w.astype(xp.float32), q.block)
    absmax = xp.max(xp.abs(x), axis=-1)
    # An all-zero block reads back as zeros whatever its codes; 1 keeps them finite.
    unit = x / xp.where(absmax == 0, 1, absmax)[..., None]
    if q.kind == "int8":
        codes = xp.clip(xp.round(unit * 127), -127, 127).astype(xp.int8).reshape(w.shape)
        # The step between codes, so that reading back is one product; formed as a
        # product by 1/127 as XLA compiles a division by 127, so that the host's numpy
        # (the import) and the devices' jax (init) make the same bits.
        return codes, (absmax * np.float32(1 / 127)).astype(xp.float32)
    idx = xp.searchsorted(xp.asarray(_NF4_MIDPOINTS), unit.reshape(w.shape)).astype(xp.uint8)
    return (idx[..., 0::2] << 4) | idx[..., 1::2], absmax


def dequantize(codes: Any, scales: Any, q: QuantConfig, dtype: Any = np.float32) -> Any:
    """The weight ``quantize`` stored, in float32, then cast to ``dtype``."""
    xp = _xp(codes)
    if q.kind == "int8":
        unit = codes.astype(xp.float32)
    else:
        idx = xp.stack([codes >> 4, codes & 15], axis=-1).reshape(*codes.shape[:-1], -1)
        unit = xp.asarray(NF4)[idx.astype(xp.int32)]
    w = _blocks(unit, q.block) * scales.astype(xp.float32)[..., None]
    return w.reshape(unit.shape).astype(dtype)


class Quantized(nnx.Module):
    """A frozen weight stored as ``quantize`` makes it: ``codes`` and ``scales``, each
    carrying the weight's logical names (``layers.use_param`` dequantises it at use)."""

    def __init__(self, weight: nnx.Param, q: QuantConfig):
        names = tuple(weight.get_metadata()["logical_axes"])
        codes, scales = quantize(weight[...], q)
        self.codes = nnx.Param(codes, logical_axes=names)
        # The scales' last axis (one per block) unsplit: its length, the weight's over the
        # block, need not divide as the weight's does (GPT-OSS's 2880 / 64 = 45 blocks
        # over 8 devices); a device slices its blocks' scales out where it uses them.
        self.scales = nnx.Param(scales, logical_axes=(*names[:-1], None))
        self.q = q


def quantize_weights(module: nnx.Module, names: tuple[str, ...], q: QuantConfig) -> None:
    """Replaces each weight ``names`` of ``module`` by its ``Quantized`` form."""
    for name in names:
        setattr(module, name, Quantized(getattr(module, name), q))


def is_quantized(tree: Any) -> bool:
    return isinstance(tree, dict) and set(tree) == {"codes", "scales"}


def dequantized(params: Any, q: QuantConfig | None, dtype: Any = jnp.float32) -> Any:
    """A parameter dict with every quantized weight (a ``{codes, scales}`` dict) read
    back in ``dtype``, keeping its sharding: what export and merging see."""
    if q is None:
        return params

    def walk(node):
        if is_quantized(node):
            sharding = getattr(node["codes"], "sharding", None)
            return jax.jit(lambda c, s: dequantize(c, s, q, dtype),
                           out_shardings=sharding)(node["codes"], node["scales"])
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node
    return walk(params)
