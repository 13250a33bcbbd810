"""MXFP4 weights read from a checkpoint: GPT-OSS's experts, as the Hub ships them.

openai/gpt-oss-20b and -120b store each layer's ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj`` as two uint8 tensors, ``{name}_blocks`` of shape
``(E, rows, G, 16)`` and ``{name}_scales`` of shape ``(E, rows, G)`` (config.json's
``quantization_config``: ``quant_method`` "mxfp4"). Row ``r`` of expert ``e`` holds
``G * 32`` values in blocks of 32: each byte of a block two FP4 (E2M1) codes, the low
nibble first (even position), the high nibble second (odd position), decoded through
``FP4_VALUES`` (bit 3 the sign); each block times ``2 ** (scale - 127)``, its E8M0
scale byte. Both tensors are the transpose of the layout the bf16 checkpoints have, and
that ndjax's import reads: ``gate_up_proj`` (E, hidden, 2 * intermediate) is stored as
rows of 2 * intermediate by hidden values, ``down_proj`` (E, intermediate, hidden) as
rows of hidden by intermediate.

This is transformers' reading (``transformers.integrations.mxfp4.
convert_moe_packed_tensors``: decode, ``ldexp``, then ``transpose(1, 2)``), in numpy and
equal to it bit for bit (tests/test_mxfp4.py): ``dequantize_rows`` decodes in the stored
layout, ``dequantize`` adds the transpose. Every value is exact in float32 and bfloat16
(at most 3 significant bits, exponents within float32's); scale byte 255 (NaN in the MX
specification) gives transformers' ``ldexp`` results, infinities and finite values
alike, not NaN.

``Mxfp4Slice`` is the dequantized tensor in the bf16 layout as a lazy safetensors slice
(``get_shape``, ``__getitem__``) of the two files' slices, for ``ndjax.runs.hf``: an index
reads only the experts, rows and blocks it covers, a chunk of experts at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# transformers' FP4_VALUES: E2M1 codes 0..15, bit 3 the sign.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16  # 32 values to a scale
SCALE_BIAS = 127  # E8M0: a scale byte s is 2 ** (s - 127)
# Bytes of float32 values that one read of ``Mxfp4Slice`` decodes (at least one expert).
_CHUNK_BYTES = 32 << 20
# Byte -> the value of its low nibble, of its high nibble (float32, exact).
_CODES = np.arange(256)
_LOW = np.asarray(FP4_VALUES, np.float32)[_CODES & 0x0F]
_HIGH = np.asarray(FP4_VALUES, np.float32)[_CODES >> 4]


def _check(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks of shape {blocks.shape} need scales of shape "
                         f"{blocks.shape[:-1]}, not {scales.shape}")


def _scaled(out: np.ndarray, exponents: np.ndarray, dtype: Any) -> np.ndarray:
    """``out`` (float32 codes' values) times 2 ** ``exponents``, as transformers'
    ``torch.ldexp`` (scale 255: 0.5 * 2 ** 128 is 2 ** 127, 1.0 * 2 ** 128 inf, 0 stays
    0), then in ``dtype``: exact in float32, so one cast rounds as torch's ldexp into a
    tensor of ``dtype`` does."""
    with np.errstate(over="ignore"):
        np.ldexp(out, exponents, out=out)
        return out if np.dtype(dtype) == out.dtype else out.astype(dtype)


def dequantize_rows(blocks: np.ndarray, scales: np.ndarray,
                    dtype: Any = np.float32) -> np.ndarray:
    """Blocks ``(*prefix, G, B)`` and scales ``(*prefix, G)`` (uint8) -> the values
    ``(*prefix, G * B * 2)`` in ``dtype``, in the stored layout (no transpose): byte
    ``blocks[..., g, b]`` gives values ``g * 2B + 2b`` (its low nibble) and ``+ 1`` (its
    high nibble), times ``2 ** (scales[..., g] - 127)``."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check(blocks, scales)
    *prefix, groups, width = blocks.shape
    out = np.empty((*prefix, groups, width, 2), np.float32)
    out[..., 0] = _LOW[blocks]
    out[..., 1] = _HIGH[blocks]
    exponents = scales.astype(np.int32) - SCALE_BIAS
    return _scaled(out, exponents[..., None, None], dtype).reshape(*prefix, groups * width * 2)


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """transformers' ``convert_moe_packed_tensors(blocks, scales, dtype=...)`` in numpy, bit
    for bit: experts' blocks ``(E, rows, G, B)`` and scales ``(E, rows, G)`` -> ``(E,
    G * 2B, rows)``, which is ``dequantize_rows(...).swapaxes(1, 2)`` (C order; decoded
    straight into that layout, the bytes transposed rather than the values). For
    MXFP4's B = 16 that is the bf16 checkpoint's layout: ``gate_up_proj`` (E, hidden,
    2 * intermediate), ``down_proj`` (E, intermediate, hidden)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check(blocks, scales)
    if blocks.ndim != 4:
        raise ValueError(f"MXFP4 experts' blocks are (E, rows, G, B), not {blocks.shape}")
    experts, rows, groups, width = blocks.shape
    flipped = np.ascontiguousarray(blocks.transpose(0, 2, 3, 1))  # (E, G, B, rows)
    out = np.empty((experts, groups, width, 2, rows), np.float32)
    out[:, :, :, 0] = _LOW[flipped]
    out[:, :, :, 1] = _HIGH[flipped]
    exponents = (scales.astype(np.int32) - SCALE_BIAS).transpose(0, 2, 1)  # (E, G, rows)
    out = _scaled(out, exponents[:, :, None, None], dtype)
    return out.reshape(experts, groups * width * 2, rows)


def dequantized_shape(blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``dequantize`` gives experts' blocks and scales of these shapes: (E,
    G * 32, rows). ValueError, saying why, for shapes that are not such a pair."""
    blocks, scales = tuple(blocks), tuple(scales)
    if len(blocks) != 4 or blocks[-1] != BLOCK_BYTES or blocks[:-1] != scales:
        raise ValueError(f"blocks of shape {blocks} and scales of shape {scales} are not "
                         f"MXFP4 experts' (E, rows, G, {BLOCK_BYTES}) and (E, rows, G)")
    experts, rows, groups, width = blocks
    return (experts, groups * width * 2, rows)


def _span(index: Any, n: int) -> range:
    if isinstance(index, slice):
        return range(n)[index]
    i = int(index)  # an integer index
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for an axis of size {n}")
    return range(i % n, i % n + 1)


def _local(span: range, lo: int) -> slice:
    """``span`` as a slice of an array that starts at ``lo``."""
    start = span.start - lo
    stop = start + len(span) * span.step
    return slice(start, stop if stop >= 0 else None, span.step)


class Mxfp4Slice:
    """An MXFP4 tensor in the bf16 layout (``dequantize``'s: (E, G * 32, rows)) as a
    safetensors slice: ``get_shape()``, and ``[index]`` -> float32 (the reader casts).

    ``blocks`` and ``scales`` are the two tensors' safetensors slices
    (``safe_open(...).get_slice(name)``), or arrays. An index (slices of any step,
    integers, ``...``; on up to 3 axes) reads from the files only the experts, rows and
    blocks of 32 values that it covers, decodes a chunk of experts at a time (at most
    ``_CHUNK_BYTES`` of float32, and at least one expert) and cuts the rest on the host:
    the host holds the result plus one chunk.
    """

    def __init__(self, blocks: Any, scales: Any):
        self.blocks, self.scales = blocks, scales
        self.shape = dequantized_shape(_shape(blocks), _shape(scales))

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = key.index(Ellipsis)
            key = (*key[:at], *[slice(None)] * (3 - len(key) + 1), *key[at + 1:])
        if len(key) > 3 or not all(isinstance(k, slice) or np.ndim(k) == 0 for k in key):
            raise IndexError(f"Mxfp4Slice takes up to 3 slices or integers, not {key!r}")
        key = (*key, *[slice(None)] * (3 - len(key)))
        experts, columns, rows = (_span(k, n) for k, n in zip(key, self.shape))
        out = np.empty((len(experts), len(columns), len(rows)), np.float32)
        if out.size:
            # Of each row, the blocks of 32 values that hold the columns asked for.
            first, last = min(columns), max(columns)
            width = 2 * BLOCK_BYTES
            groups = slice(first // width, last // width + 1)
            columns = _local(columns, groups.start * width)
            row_span = slice(min(rows), max(rows) + 1)
            rows = _local(rows, row_span.start)
            per_expert = 4 * (groups.stop - groups.start) * width * (row_span.stop - row_span.start)
            step = max(1, _CHUNK_BYTES // per_expert) if experts.step == 1 else 1
            for at in range(0, len(experts), step):
                chosen = experts[at:at + step]
                read = slice(chosen.start, chosen.start + len(chosen))  # consecutive
                values = dequantize(np.asarray(self.blocks[read, row_span, groups]),
                                    np.asarray(self.scales[read, row_span, groups]))
                out[at:at + len(chosen)] = values[:, columns, rows]
        drop = tuple(0 if not isinstance(k, slice) else slice(None) for k in key)
        return out[drop]


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else np.shape(tensor))

