"""Hugging Face checkpoints of every family in and out, through the ``safetensors`` library.

Import: ``open_checkpoint`` checks a local directory (``config.json`` plus one
or more ``.safetensors`` files) before anything compiles: the family from
``config.json``'s ``model_type`` (``ndjax.models.registry``), the model from the
family's reading of ``config.json``, every tensor's dtype and shape from the file
headers against the family's parameter names.
``load_params`` then builds every parameter directly in its target sharding,
each device's shard read lazily (``safe_open(...).get_slice(name)[index]``:
only that shard's bytes, a chunk at a time), so the host holds about one shard.
MXFP4 experts (GPT-OSS on the Hub: uint8 ``X_blocks`` and ``X_scales`` in place of
``X``) are the tensor ``X`` in its bf16 shape from the headers on, read through a
view that dequantizes the experts each read covers (``ndjax.models.mxfp4``, ``_slice``).
``check_adapter`` and ``load_adapter`` do the same for a PEFT adapter directory
(model.lora.init_from): ``export_adapter``'s inverse, from the same table of names.

Export: ``export`` writes a directory that ``transformers`` loads. The tensors
are first planned into files of at most ``export.max_shard_size`` bytes, named
and indexed (``model.safetensors.index.json``) as transformers does; then each
file's tensors are gathered to the host (per Hugging Face tensor, i.e. per
layer), written with ``safetensors.numpy.save_file`` and freed, so the host
holds about one file. Everything goes into a temporary directory renamed into
place at the end. The token ids (config.json's, generation_config.json's) are the
run's tokenizer's, and its tokenizer files go along, so that transformers'
generate stops where training ended documents and AutoTokenizer loads the export.

Files are opened with ``framework="numpy"``: it returns host arrays (bfloat16
through ml_dtypes, which jax registers) that go straight to their devices,
where "flax" would first copy each slice to the default device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from jax.experimental import multihost_utils
from safetensors import SafetensorError, safe_open

# The export fields' forms (dtypes, shard size) are ndjax.config's, which checks them
# without importing this module; shard_size keeps its name here too (hf.shard_size).
from ndjax.config import (  # noqa: F401
    EXPORT_DTYPES,
    MODEL_DIMS,
    SHARD_BYTES,
    ExportSettings,
    ModelSettings,
    Settings,
    default_config,
    shard_size,
)
from ndjax.data.loader import data_tokenizer
from ndjax.data.tokenizers import HFTokenizer, Tokenizer
from ndjax.models import decoder, lora, mxfp4, registry
from ndjax.models import quant as quant_lib
from ndjax.models.decoder import DecoderConfig
from ndjax.models.quant import QuantConfig
from ndjax.runtime.errors import ConfigError

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(jnp.bfloat16)}
# Also read: uint8 pairs X_blocks + X_scales, the MXFP4 tensor X (ndjax.models.mxfp4).
_MXFP4_DTYPE = "U8"
_MXFP4_PARTS = ("_blocks", "_scales")
_READS = f"{sorted(_DTYPES)} and MXFP4 experts (U8 pairs NAME_blocks, NAME_scales)"
# A shard is read in this many chunks (of at most _CHUNK_CAP bytes each), so that
# the host holds the shard plus one chunk of the file, not two copies of the shard.
_CHUNKS = 32
_CHUNK_CAP = 32 << 20
# Files of the source directory that a Hugging Face user expects next to the weights:
# the tokenizer's (which the run's own tokenizer replaces, when the export knows it)...
_TOKENIZER_FILES = re.compile(r"(tokenizer|special_tokens_map|added_tokens|chat_template)"
                              r"[\w.-]*")
# ... and the model's.
_MODEL_FILES = re.compile(r"generation_config[\w.-]*")
# Left in old checkpoints by transformers < 4.31; recomputed from config.json.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

def _hf_shape(shape: tuple[int, ...], split: int | str | None) -> tuple[int, ...]:
    """The Hugging Face tensor's shape of an ndjax parameter (``Family.hf_names``'
    ``split``)."""
    if split is None:
        return shape
    if split == registry.FLAT:
        return (math.prod(shape),)
    if split in registry.INTERLEAVED:
        return (*shape[:-1], 2 * shape[-1])
    return (math.prod(shape[split:]), math.prod(shape[:split]))


def _groups(ndim: int, split: int | str | None) -> list[list[int]]:
    """The ndjax axes each Hugging Face axis holds, flattened, in order."""
    if split is None or split in registry.INTERLEAVED:
        return [[a] for a in range(ndim)]
    if split == registry.FLAT:
        return [list(range(ndim))]
    return [list(range(split, ndim)), list(range(split))]


# ----- safetensors files --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one HF tensor is, from its file's header."""

    path: str
    shape: tuple[int, ...]
    # An MXFP4 tensor (``shape``: dequantized, the bf16 layout's): the (file, name) of its
    # blocks and of its scales, which may be in two files (``path`` is the blocks').
    mxfp4: tuple[tuple[str, str], tuple[str, str]] | None = None


def _read_header(path: str) -> dict[str, _Entry]:
    """Every tensor of one .safetensors file; the library checks the header and offsets."""
    return _read_headers([path])


def _read_headers(paths: list[str]) -> dict[str, _Entry]:
    """Every tensor of the files (a later file's name wins), an MXFP4 pair X_blocks +
    X_scales (uint8, in any two of the files) as the one tensor X (``_Entry.mxfp4``)."""
    entries: dict[str, _Entry] = {}
    parts: dict[str, tuple[str, tuple[int, ...]]] = {}  # MXFP4 part name -> file, shape
    for path in paths:
        try:
            with safe_open(path, framework="numpy") as f:
                slices = {name: f.get_slice(name) for name in f.keys()}
                found = {name: (s.get_dtype(), tuple(s.get_shape()))
                         for name, s in slices.items()}
        except SafetensorError as e:
            raise ConfigError(f"{path} is not a readable safetensors file ({e}). Re-save it "
                              "with transformers' save_pretrained.") from e
        for name, (code, shape) in found.items():
            if code == _MXFP4_DTYPE and name.endswith(_MXFP4_PARTS):
                parts[name] = (path, shape)
            elif code not in _DTYPES:
                raise ConfigError(f"{path}: tensor {name} has dtype {code}; ndjax reads "
                                  f"{_READS}. Convert the checkpoint first.")
            else:
                entries[name] = _Entry(path, shape)
    for name in sorted(parts):
        base, part = name[:-len("_blocks")], name[-len("_blocks"):]
        other = base + _MXFP4_PARTS[part == "_blocks"]
        path, shape = parts[name]
        if other not in parts:
            raise ConfigError(f"{path}: tensor {name} (U8) has no {other} (U8) in the "
                              f"checkpoint's files; ndjax reads {_READS}. Download the "
                              "whole checkpoint.")
        if part == "_scales":
            continue
        scales_path, scales_shape = parts[other]
        try:
            full = mxfp4.dequantized_shape(shape, scales_shape)
        except ValueError as e:
            raise ConfigError(f"{path}: MXFP4 tensor {base}: {e}. Convert the checkpoint "
                              "first.") from None
        if base in entries:
            raise ConfigError(f"{path}: tensor {base} is in the files both as it is and as "
                              "MXFP4 blocks and scales. Download the checkpoint again.")
        entries[base] = _Entry(path, full, ((path, name), (scales_path, other)))
    return entries


def _slice(files: dict[str, Any], entry: _Entry, name: str) -> Any:
    """Tensor ``name`` (``entry``) as a safetensors slice (``get_shape``, ``[index]``) of
    the open ``files`` (path -> ``safe_open``): its file's ``get_slice``, or for an MXFP4
    tensor a ``mxfp4.Mxfp4Slice`` of its blocks and scales (float32 in the bf16 layout).
    A file that only an MXFP4 tensor's scales are in is opened into ``files``."""
    if entry.mxfp4 is None:
        return files[entry.path].get_slice(name)
    for path, _ in entry.mxfp4:
        if path not in files:  # closed when ``files`` goes
            files[path] = safe_open(path, framework="numpy")
    (blocks_path, blocks), (scales_path, scales) = entry.mxfp4
    return mxfp4.Mxfp4Slice(files[blocks_path].get_slice(blocks),
                            files[scales_path].get_slice(scales))


def _check_quantization(config: dict, where: str) -> None:
    """config.json's ``quantization_config``: only MXFP4's (GPT-OSS's experts) is read."""
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "mxfp4":
        raise ConfigError(f"{where}: config.json has quantization_config with quant_method="
                          f"{method!r}; ndjax reads bf16, f32 and f16 weights and MXFP4 "
                          "experts (quant_method 'mxfp4'). Use the unquantized checkpoint.")


def _fill(out: np.ndarray, tensor: Any, shape: tuple[int, ...], split: int | None,
          index: tuple[slice, ...]) -> None:
    """Writes shard ``index`` of an ndjax parameter (layout ``shape``) into ``out``.

    ``tensor`` is the HF tensor's safetensors slice (``get_slice``): only the rows
    of this shard are read, a chunk of at most 1/_CHUNKS of ``out`` at a time, so
    the host holds ``out`` plus one chunk. HF axis 0 holds the ndjax axes
    ``shape[split:]`` flattened, axis 1 ``shape[:split]`` (split None: the same
    axes). Of each group only its first axis is sliced in the file; the others
    (which the rule presets never shard; a custom table may) are read whole and
    cut on the host.
    """
    groups = _groups(len(shape), split)
    hf_order = [a for g in groups for a in g]
    if not all(groups):
        # An HF axis of size 1 that holds no ndjax axis: a vector stored as a (1, n)
        # Linear (Qwen 2 MoE's shared expert gate). Small: read whole, cut here.
        whole = np.asarray(tensor[:]).reshape([shape[a] for a in hf_order])
        out[...] = whole.transpose(np.argsort(hf_order))[index]
        return
    spans = [range(n)[i] for n, i in zip(shape, index)]
    inner = [math.prod(shape[a] for a in g[1:]) for g in groups]
    lead = groups[0][0]  # the ndjax axis that the file's rows step through
    row_bytes = out.nbytes // len(spans[lead])
    rows = max(1, min(_CHUNK_CAP, out.nbytes // _CHUNKS) // max(1, row_bytes))
    for lo in range(spans[lead].start, spans[lead].stop, rows):
        hi = min(lo + rows, spans[lead].stop)
        first = [range(lo, hi)] + [spans[g[0]] for g in groups[1:]]
        block = tensor[tuple(slice(f.start * n, f.stop * n) for f, n in zip(first, inner))]
        block = block.reshape([len(f) if a == g[0] else shape[a]
                               for f, g in zip(first, groups) for a in g])
        block = block[tuple(slice(None) if a == g[0] else slice(spans[a].start, spans[a].stop)
                            for g in groups for a in g)]
        dst = [slice(None)] * len(shape)
        dst[lead] = slice(lo - spans[lead].start, hi - spans[lead].start)
        out[tuple(dst)] = block.transpose(np.argsort(hf_order))  # casts to out's dtype


# ----- import ---------------------------------------------------------------------


@dataclasses.dataclass
class Checkpoint:
    """A checked local Hugging Face directory of a supported family."""

    directory: str
    config: dict          # config.json as read
    dims: dict            # DecoderConfig fields from config.json, the family's included
    tensors: dict[str, _Entry]  # Hugging Face tensor name -> its file and shape
    # The vocabulary rows in the files, where dims' vocab_size was grown past them to
    # hold added tokens (``grow_vocab``); None: as the files have them.
    file_vocab: int | None = None


# The Hugging Face tensors whose rows are the vocabulary (axis 0 in every family).
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def grow_vocab(ckpt: Checkpoint, vocab_size: int) -> Checkpoint:
    """``ckpt`` with room for ``vocab_size`` ids (a tokenizer with added tokens): the
    embedding and LM head get rows past the files' that start at the mean of their rows
    (``_GrownRows``), as transformers' ``resize_token_embeddings(mean_resizing=True)``
    starts them but without its random spread. No change if the files have the room."""
    if vocab_size <= ckpt.dims["vocab_size"]:
        return ckpt
    return dataclasses.replace(ckpt, dims={**ckpt.dims, "vocab_size": vocab_size},
                               file_vocab=ckpt.dims["vocab_size"])


class _Columns:
    """The even or odd columns of an HF tensor's last axis (``registry.EVEN`` / ``ODD``),
    read as a safetensors slice of its own: a read of columns [a, b) reads the HF
    columns [2a, 2b) and keeps every other one."""

    def __init__(self, tensor: Any, part: str):
        self.tensor, self.first = tensor, registry.INTERLEAVED.index(part)

    def get_shape(self) -> list[int]:
        shape = list(self.tensor.get_shape())
        return [*shape[:-1], shape[-1] // 2]

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        shape = self.get_shape()
        key = key + (slice(None),) * (len(shape) - len(key))
        lo, hi, _ = key[-1].indices(shape[-1])
        block = np.asarray(self.tensor[(*key[:-1], slice(2 * lo, 2 * hi))])
        return block[..., self.first::2]


def interleave(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    """The HF tensor whose even and odd columns (last axis) are ``even`` and ``odd``."""
    out = np.empty((*even.shape[:-1], 2 * even.shape[-1]), even.dtype)
    out[..., 0::2], out[..., 1::2] = even, odd
    return out


class _GrownRows:
    """A vocabulary tensor's safetensors slice with rows ``file_rows..rows`` added, each
    the mean of the file's rows (float32, read a chunk at a time)."""

    def __init__(self, tensor: Any, rows: int):
        self.tensor, self.rows = tensor, rows
        self.file_rows = tensor.get_shape()[0]

    @functools.cached_property
    def mean(self) -> np.ndarray:
        total = np.zeros(self.tensor.get_shape()[1:], np.float64)
        step = max(1, _CHUNK_CAP // max(1, 4 * math.prod(total.shape)))
        for lo in range(0, self.file_rows, step):
            block = np.asarray(self.tensor[lo:min(lo + step, self.file_rows)], np.float32)
            total += block.sum(axis=0, dtype=np.float64)
        return (total / self.file_rows).astype(np.float32)

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        lo, hi, _ = key[0].indices(self.rows)
        rest = key[1:]
        parts = []
        if lo < self.file_rows:
            parts.append(np.asarray(self.tensor[(slice(lo, min(hi, self.file_rows)), *rest)],
                                    np.float32))
        if hi > self.file_rows:
            mean = self.mean[rest] if rest else self.mean
            parts.append(np.broadcast_to(mean, (hi - max(lo, self.file_rows), *mean.shape)))
        return np.concatenate(parts)


def _expected_shapes(dims: dict) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the family's model with these dims has, with its
    shape: the family's names for the parameters of the model it builds."""
    cfg = DecoderConfig(**dims)
    top, _ = registry.of(cfg).hf_names(cfg)
    shapes = _param_shapes(cfg)
    out = {name: _hf_shape(_at(shapes, path).shape, split) for path, (name, split) in top.items()}
    for stack in decoder.stacks(cfg):
        for path, (name, split) in registry.of(cfg).hf_names(cfg, stack.moe)[1].items():
            shape = _at(shapes[stack.name], path).shape[1:]
            for each, e in registry.expert_names(name, shape):
                one = shape if e is None else shape[1:]
                out.update({f"model.layers.{i}.{each}": _hf_shape(one, split)
                            for i in range(stack.first, stack.stop)})
    return out


def _param_shapes(cfg: DecoderConfig) -> Any:
    from flax import nnx
    model = nnx.eval_shape(lambda: decoder.Decoder(cfg, nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing or not names:
            raise ConfigError(
                f"model.init_from={directory!r}: model.safetensors.index.json names "
                f"{missing or 'no'} files that are not there. Download the whole checkpoint.")
        return [os.path.join(directory, n) for n in names]
    if os.path.isfile(single):
        return [single]
    other = [n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth"))]
    fix = (f"It has {sorted(other)}: re-save it with transformers' save_pretrained, which "
           "writes safetensors." if other else "Download the weights too.")
    raise ConfigError(f"model.init_from={directory!r} has no model.safetensors or "
                      f"model.safetensors.index.json. {fix}")


def _prediction_layer(name: str, config: dict, n_layers: int) -> bool:
    """Whether ``name`` is a multi-token-prediction layer's (DeepSeek V3's
    ``num_nextn_predict_layers``, stored as the layers after the model's), which ndjax
    does not read."""
    extra = config.get("num_nextn_predict_layers") or 0
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(extra and found and n_layers <= int(found.group(1)) < n_layers + extra)


def open_checkpoint(directory: str, field: str = "model.init_from") -> Checkpoint:
    """Checks a local HF Llama directory (config, files, every tensor's shape); reads no data.
    ``field``: the config field that names it, in errors."""
    if not os.path.isdir(directory):
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", directory) and not os.path.exists(directory)
        fix = (f" If {directory!r} is a Hugging Face hub id: ndjax does not download, so run "
               f"`hf download {directory} --local-dir DIR` first and pass "
               f"--config.{field}=DIR." if hub else "")
        raise ConfigError(f"{field}={directory!r} is not a local directory.{fix}")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{field}={directory!r} has no config.json. Point it at a "
                          "directory written by transformers' save_pretrained.")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{field}={directory!r}: config.json is not JSON ({e}).") from e
    _check_quantization(config, f"{field}={directory!r}")
    family = registry.for_config_json(config, directory)
    dims = family.read_config_json(config, directory)
    tensors = _read_headers(_weight_files(directory))
    expected = _expected_shapes(dims)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(n for n in set(tensors) - set(expected) if not _IGNORED.fullmatch(n)
                   and not (n == "lm_head.weight" and dims["tie_embeddings"])
                   and not _prediction_layer(n, config, dims["n_layers"]))
    if missing or extra:
        raise ConfigError(
            f"{field}={directory!r}: the weights do not match config.json (e.g. "
            f"model_type={config.get('model_type')!r}, num_hidden_layers={dims['n_layers']}, "
            "tie_word_embeddings="
            f"{dims['tie_embeddings']}): missing {missing[:4]}, unexpected {extra[:4]}. Use the "
            "config.json that was saved with these weights.")
    for name, shape in expected.items():
        actual = tensors[name].shape
        if actual != shape:
            raise ConfigError(
                f"{field}={directory!r}: tensor {name} has shape {actual}, but "
                f"config.json implies {shape} (hidden_size={dims['dim']}, intermediate_size="
                f"{dims['ffn_dim']}, heads={dims['n_heads']}, kv heads={dims['n_kv_heads']}, "
                f"head_dim={dims['head_dim']}, vocab_size={dims['vocab_size']}). Use the "
                "config.json that was saved with these weights.")
    return Checkpoint(directory, config, dims, tensors)


def override_dims(model: ModelSettings, ckpt: Checkpoint) -> dict:
    """The checkpoint's model, with a warning naming each config field it overrides;
    training choices the checkpoint also records (``registry.TRAINING_FIELDS``: the
    load-balancing loss's weight) are the config's where it sets them."""
    fields = ("family", *MODEL_DIMS,
              *(f for f in registry.OPTION_FIELDS if f not in registry.TRAINING_FIELDS))
    defaults = default_config().model
    set_ = {f: getattr(model, f) for f in fields
            if getattr(model, f) is not None and getattr(model, f) != defaults[f]}
    asked = [(f"model.{f}={v!r}", f, v) for f, v in set_.items()]
    # A preset other than the default was chosen on purpose: say so if it is ignored.
    family = registry.families().get(model.family)
    preset = family.presets.get(model.preset) if family else None
    if model.preset != defaults.preset and preset:
        asked += [(f"{f}={preset[f]!r} of model.preset={model.preset!r}", f, preset[f])
                  for f in fields if f not in set_ and f in preset]
    def same(f: str, value: Any) -> bool:  # sliding_window 0 in a config means none
        return (value or None if f == "sliding_window" else value) == ckpt.dims.get(f)
    changed = [f"{label} -> {ckpt.dims.get(f)!r}" for label, f, value in asked
               if not same(f, value)]
    if changed:
        warnings.warn(f"model.init_from={ckpt.directory!r}: config.json overrides "
                      f"{', '.join(changed)}. Drop those fields: the checkpoint sets the model.",
                      stacklevel=3)
    dims = dict(ckpt.dims)
    chosen = {f: getattr(model, f) for f in registry.TRAINING_FIELDS
              if getattr(model, f) is not None}
    registry.check_options(registry.get(dims["family"]), chosen)
    return {**dims, **chosen}


def check_tokenizer(config: Settings, ckpt: Checkpoint) -> None:
    """Warns when text would be tokenized with bytes while the checkpoint has its own tokenizer."""
    path = os.path.join(ckpt.directory, "tokenizer.json")
    d = config.data
    if d.source in ("text", "jsonl", "parquet", "builtin") and d.tokenizer == "byte" \
            and os.path.isfile(path):
        warnings.warn(f"model.init_from={ckpt.directory!r} has a tokenizer.json, but "
                      f"data.tokenizer='byte' feeds the model byte ids. Set "
                      f"--config.data.tokenizer={path} to train on the checkpoint's tokens.",
                      stacklevel=3)


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _put(shape: tuple[int, ...], sharding: jax.sharding.Sharding, read) -> jax.Array:
    """Builds a sharded array from ``read(index)``, one device shard on the host at a time.

    Unlike jax.make_array_from_callback, which holds every local shard on the host
    before transferring any, each shard is copied to its devices and dropped before
    the next is read: host memory stays at one shard.
    """
    by_index: dict[tuple, tuple[tuple[slice, ...], list]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_index.setdefault(_index_key(index), (index, []))[1].append(device)
    buffers = []
    for index, devices in by_index.values():
        host = read(index)
        puts = [jax.device_put(host, d) for d in devices]
        jax.block_until_ready(puts)
        buffers += puts
        del host
        # jaxlib lets go of the host array from its transfer thread through a gc
        # callback (jax-ml/jax#14882); a young-generation collection runs it now,
        # cheaply. Without it, shards pile up on the host until the next collection.
        gc.collect(0)
    return jax.make_array_from_single_device_arrays(shape, sharding, buffers)


def load_params(ckpt: Checkpoint, shapes: Any, shardings: Any,
                quant: QuantConfig | None = None) -> Any:
    """The checkpoint as an ndjax parameter dict, every array created in its sharding.

    ``shapes`` and ``shardings`` are the Experiment's ``param_shapes`` and
    ``state_sharding.params``. Each device's shard is read lazily from the files
    (safetensors' ``get_slice``); for the stacked layer parameters, only the
    layers in that shard. Values are converted to the parameters' dtype
    (``shapes``), rounding to nearest even. Under ``quant`` (QLoRA), a weight stored
    quantized (``codes`` and ``scales``) is quantized shard by shard on the host as it
    is read, from the checkpoint's values in float32: the host holds one shard of the
    weight, and the scales of the shards whose codes went first.
    """
    cfg = DecoderConfig(**ckpt.dims)
    top, _ = registry.of(cfg).hf_names(cfg)
    stacks = {s.name: (s, registry.of(cfg).hf_names(cfg, s.moe)[1]) for s in decoder.stacks(cfg)}
    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(safe_open(path, framework="numpy"))
                 for path in sorted({e.path for e in ckpt.tensors.values()})}

        grown: dict[str, _GrownRows] = {}  # one per tensor: its mean is read once

        def tensor(name: str) -> Any:
            found = _slice(files, ckpt.tensors[name], name)
            if ckpt.file_vocab is not None and name in VOCAB_TENSORS:
                return grown.setdefault(name, _GrownRows(found, ckpt.dims["vocab_size"]))
            return found

        def load(path, shape, sharding):
            dtype = np.dtype(shape.dtype)
            keys = tuple(str(k.key) for k in path)
            shard = sharding.shard_shape(shape.shape)
            if keys[0] not in stacks:
                name, split = top[keys]

                def read_top(index):
                    out = np.empty(shard, dtype)
                    _fill(out, tensor(name), shape.shape, split, index)
                    return out
                return _put(shape.shape, sharding, read_top)
            part = keys[-1] if quant is not None and keys[-1] in ("codes", "scales") else None
            weight_keys = keys[1:-1] if part else keys[1:]
            layer_stack, per_layer = stacks[keys[0]]
            hf_name, split = per_layer[weight_keys]
            full = shape.shape
            if part:  # the weight's shape, of which these are the codes or the scales
                per = quant.block if part == "scales" else (2 if quant.kind == "nf4" else 1)
                full = (*full[:-1], full[-1] * per)
            experts = registry.expert_names(hf_name, full[1:])

            def read(index, out_dtype=dtype):
                # The stack's layers of this shard, as the model's (HF's) indices.
                layers = [layer_stack.first + i for i in range(full[0])[index[0]]]
                out = np.empty((len(layers), *(len(range(n)[i]) for n, i in
                                               zip(full[1:], index[1:], strict=True))),
                               out_dtype)
                for j, i in enumerate(layers):
                    if experts[0][1] is None:
                        source = tensor(f"model.layers.{i}.{hf_name}")
                        if split in registry.INTERLEAVED:
                            source = _Columns(source, split)
                        _fill(out[j], source, full[1:],
                              None if split in registry.INTERLEAVED else split, index[1:])
                        continue
                    # One tensor per expert: the parameter's leading axis.
                    for m, e in enumerate(range(full[1])[index[1]]):
                        _fill(out[j, m], tensor(f"model.layers.{i}.{experts[e][0]}"),
                              full[2:], split, index[2:])
                return out
            if not part:
                return _put(shape.shape, sharding, read)

            def read_quantized(index):
                last = index[-1].indices(shape.shape[-1])
                weight_index = (*index[:-1], slice(last[0] * per, last[1] * per))
                key = (keys[0], weight_keys, _index_key(weight_index))
                if part == "scales" and key in later_scales:
                    return later_scales.pop(key)
                codes, scales = quant_lib.quantize(read(weight_index, np.float32), quant)
                if part == "scales":
                    return scales
                later_scales[key] = scales  # for the scales' shard of the same values
                return codes
            return _put(shape.shape, sharding, read_quantized)

        later_scales: dict[tuple, np.ndarray] = {}
        return jax.tree_util.tree_map_with_path(load, shapes, shardings)


# ----- export ---------------------------------------------------------------------


def check_export(export: ExportSettings) -> None:
    """Up-front checks of the export fields, so a run never fails at its end."""
    # (export.dtype's choices and the size's form: ndjax.config, checked before this.)
    for name in ("hf_dir", "adapter_dir"):
        out = getattr(export, name)
        if out is not None and (os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out))):
            raise ConfigError(f"export.{name}={out!r} exists and is not empty; ndjax will not "
                              "overwrite it. Remove it or choose a new directory.")
    if export.adapter_dir is not None and export.adapter_dir == export.hf_dir:
        raise ConfigError(f"export.adapter_dir and export.hf_dir are both {export.hf_dir!r}: "
                          "the adapters and the merged model need a directory each.")


def run_tokenizer(data: Any) -> Tokenizer | None:
    """The tokenizer whose ids a run trained on, for ``export``'s ``tokenizer``: ``data``
    is the run's ``config.data`` (its ``source``, ``tokenizer`` and ``eos_token``). None
    for synthetic data, whose ids are random and end no documents (and may not even
    hold the byte tokenizer's, in a vocabulary under 259)."""
    if data.source == "synthetic":
        return None
    return data_tokenizer(data)


def with_token_ids(config: dict, tokenizer: Tokenizer) -> dict:
    """``config`` (config.json or generation_config.json) with the run's token ids.

    EOS: the run's, unless ``config``'s already includes it (Llama 3 Instruct stops at
    [128001, 128008, 128009]; a run ending documents with one of them keeps all three).
    BOS: the run's, or where its tokenizer has none, ``config``'s (Qwen's config.json
    names one its tokenizer does not). PAD: the run's (any id works; it says which).
    """
    out = dict(config)
    eos = out.get("eos_token_id")
    if not (eos == tokenizer.eos_id or (isinstance(eos, list) and tokenizer.eos_id in eos)):
        out["eos_token_id"] = tokenizer.eos_id
    if tokenizer.bos_id is not None:
        out["bos_token_id"] = tokenizer.bos_id
    else:  # None, not LlamaConfig's default 1, which is some other token here
        out.setdefault("bos_token_id", None)
    out["pad_token_id"] = tokenizer.pad_id
    return out


def hf_config(cfg: DecoderConfig, dtype: str, source: dict | None = None,
              max_position_embeddings: int | None = None,
              tokenizer: Tokenizer | None = None) -> dict:
    """config.json for ``cfg`` (its family writes the fields it models); other fields
    from ``source``, token ids from ``tokenizer`` (the run's) where given, else from
    ``source``."""
    from ndjax.models.hf_config import default_positions
    out = {k: v for k, v in (source or {}).items() if k not in (
        "rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype",
        "transformers_version", "auto_map", "quantization_config", "_name_or_path")}
    out.update(registry.of(cfg).hf_config(cfg), dtype=dtype, torch_dtype=dtype)
    out.setdefault("max_position_embeddings", max_position_embeddings or default_positions(cfg))
    if tokenizer is not None:
        out = with_token_ids(out, tokenizer)
    # transformers' LlamaConfig defaults.
    for key, value in (("bos_token_id", 1), ("eos_token_id", 2), ("initializer_range", 0.02),
                       ("use_cache", True)):
        out.setdefault(key, value)
    return out


def _host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _tensors(params: Any, cfg: DecoderConfig) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """(HF name, HF shape, () -> host array in HF layout), in HF's order."""
    def entry(name, x, split, layer=None, expert=None):
        shape = x.shape if layer is None else x.shape[1:]
        if expert is not None:
            shape = shape[1:]

        def get():
            # One layer (one expert) on the host at a time.
            a = _host(x if layer is None else x[layer] if expert is None else x[layer, expert])
            if split is None or split == registry.FLAT:
                return a.reshape(_hf_shape(shape, split))
            return a.reshape(_hf_shape(shape, split)[::-1]).T
        return name, _hf_shape(shape, split), get

    def interleaved(name, parts, layer):
        """One HF tensor of two parameters' columns, interleaved (``_Columns``)."""
        even, odd = (parts[p] for p in registry.INTERLEAVED)
        return name, _hf_shape(even.shape[1:], registry.EVEN), (
            lambda: interleave(_host(even[layer]), _host(odd[layer])))

    yield entry("model.embed_tokens.weight", params["embed"], None)
    for stack in decoder.stacks(cfg):
        layers = params[stack.name]
        per_layer = registry.of(cfg).hf_names(cfg, stack.moe)[1]
        for i in range(stack.count):  # the model's layer stack.first + i
            hf_layer = f"model.layers.{stack.first + i}"
            written = set()
            for path, (name, split) in per_layer.items():
                x = _at(layers, path)
                if split in registry.INTERLEAVED:
                    if name not in written:
                        written.add(name)
                        parts = {s: _at(layers, p) for p, (n, s) in per_layer.items()
                                 if n == name}
                        yield interleaved(f"{hf_layer}.{name}", parts, i)
                    continue
                for each, e in registry.expert_names(name, x.shape[1:]):
                    yield entry(f"{hf_layer}.{each}", x, split, i, e)
    yield entry("model.norm.weight", params["final_norm"]["scale"], None)
    if "lm_head" in params:
        yield entry("lm_head.weight", params["lm_head"], 1)


def _plan(tensors: list, itemsize: int, limit: int) -> dict[str, list]:
    """File name -> its tensors, filled in order until the next would pass ``limit``
    bytes (a larger tensor gets a file of its own), named as transformers names them."""
    groups: list[list] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t[1]) * itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g
            for i, g in enumerate(groups)}


def _write_file(path: str | None, tensors: list, dtype: np.dtype) -> None:
    """Gathers one file's tensors and writes them (``path`` None: gather only).

    The file's arrays are on the host together (plus one tensor's gathered copy
    while it is converted): host memory is one file's worth, ``max_shard_size``.
    """
    arrays = {}
    for name, shape, get in tensors:
        a = get().astype(dtype, order="C")  # every process joins the gather
        assert a.shape == shape, (name, a.shape, shape)
        if path:
            arrays[name] = a
    if path:
        safetensors.numpy.save_file(arrays, path, metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # on disk before the directory is renamed into place
        finally:
            os.close(fd)


def export(params: Any, cfg: DecoderConfig, out_dir: str, dtype: str = "bfloat16", *,
           source: Checkpoint | None = None, max_position_embeddings: int | None = None,
           shard_bytes: int = SHARD_BYTES, tokenizer: Tokenizer | None = None) -> None:
    """Writes ``params`` as a Hugging Face directory of ``cfg``'s family, atomically.

    All processes must call this (the gathers are collective); process 0 writes.
    Which tensors go in which file of at most ``shard_bytes`` is planned from the
    shapes first; then each file's tensors are gathered (stacked parameters one
    layer at a time), written and freed, so host memory stays at about one file.

    ``tokenizer`` is the run's (``run_tokenizer(config.data)``; None: unknown, as for
    synthetic data). Its bos/eos/pad ids go into config.json and generation_config.json,
    and a tokenizer.json's files (tokenizer_config.json, chat template...) are copied,
    replacing ``source``'s tokenizer files: the export describes the ids the weights
    were trained on. Without it, ``source``'s token ids and files are kept. Generation
    files of ``source`` are copied along.
    """
    np_dtype = _DTYPES[EXPORT_DTYPES[dtype]]
    # A LoRA's adapters folded into their base weights: the model it trained.
    tensors = list(_tensors(lora.merged(params, cfg), cfg))
    plan = _plan(tensors, np_dtype.itemsize, shard_bytes)
    with _atomic_dir(out_dir, "ndjax.runs.hf.export") as tmp:
        for name, group in plan.items():
            _write_file(tmp and os.path.join(tmp, name), group, np_dtype)
        if tmp:
            _write_metadata(tmp, plan, np_dtype.itemsize,
                            hf_config(cfg, dtype, source and source.config,
                                      max_position_embeddings, tokenizer), source, tokenizer)


@contextlib.contextmanager
def _atomic_dir(out_dir: str, barrier: str) -> Iterator[str | None]:
    """A temporary directory beside ``out_dir`` for process 0 to write into (None on the
    others, which take part in the gathers), renamed to ``out_dir`` when the block ends
    well and removed when it raises; then every process waits at ``barrier`` until the
    directory is in place."""
    out_dir = os.path.abspath(out_dir)
    tmp = None
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-",
                               dir=os.path.dirname(out_dir))
    try:
        yield tmp
        if tmp is not None:
            os.rename(tmp, out_dir)  # replaces an empty directory; fails on a non-empty one
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(barrier)


ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def _adapter_tensors(tree: Any, cfg: DecoderConfig
                     ) -> Iterator[tuple[str, tuple[str, ...], int, int]]:
    """(PEFT's name, the path in ``tree`` of the stacked ndjax leaf, its layer, the leaf's
    split: ``_hf_shape``'s) of every adapter tensor, in the order ``export_adapter`` writes
    them. ``tree``: parameters or their shapes. One table for export and import, so the
    two cannot drift."""
    for target in cfg.lora.targets:
        module, _, n_in = lora.BASE_WEIGHTS[target]
        hf_module = f"{'self_attn' if module == 'attn' else 'mlp'}.{lora.TARGETS[target]}"
        for stack in decoder.stacks(cfg):
            if lora.PREFIX + target not in tree[stack.name][module]:
                continue
            for i in range(stack.count):
                for part, split in (("a", n_in), ("b", 1)):
                    yield (f"base_model.model.model.layers.{stack.first + i}.{hf_module}."
                           f"lora_{part.upper()}.weight",
                           (stack.name, module, lora.PREFIX + target, part), i, split)


def export_adapter(params: Any, cfg: DecoderConfig, out_dir: str,
                   base: str | None = None) -> None:
    """Writes a LoRA's adapters in PEFT's format, atomically: ``adapter_model.safetensors``
    (float32, PEFT's names: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A
    .weight`` of shape (rank, in), ``lora_B`` (out, rank)) and ``adapter_config.json``, which
    ``peft.PeftModel.from_pretrained`` loads onto the transformers base (``base``: its
    path or hub name, recorded as ``base_model_name_or_path``). All processes call it;
    process 0 writes."""
    if cfg.lora is None:
        raise ValueError("export_adapter: the model has no LoRA adapters")
    tensors = []
    for name, path, i, split in _adapter_tensors(params, cfg):
        x = _at(params, path)
        shape = _hf_shape(x.shape[1:], split)

        def get(x=x, i=i, shape=shape):
            return _host(x[i]).reshape(shape[::-1]).T
        tensors.append((name, shape, get))
    # modules_to_save, whole, under PEFT's names (the base's with its prefix): the
    # embedding (vocab, dim) as stored, the LM head stored (dim, vocab) transposed.
    for key in cfg.lora.saved_params:
        x = params[key]
        name = "model.embed_tokens.weight" if key == "embed" else "lm_head.weight"
        tensors.append((f"base_model.model.{name}", x.shape if key == "embed" else
                        x.shape[::-1], (lambda x=x: _host(x)) if key == "embed" else
                        (lambda x=x: _host(x).T)))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank,
              "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
              "use_rslora": cfg.lora.rslora,
              "target_modules": [lora.TARGETS[t] for t in cfg.lora.targets], "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True,
              "modules_to_save": list(cfg.lora.saved) or None,
              "base_model_name_or_path": base}
    with _atomic_dir(out_dir, "ndjax.runs.hf.export_adapter") as tmp:
        _write_file(tmp and os.path.join(tmp, ADAPTER_FILES[0]), tensors, np.dtype(np.float32))
        if tmp:
            with open(os.path.join(tmp, ADAPTER_FILES[1]), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)


# ----- adapters in: model.lora.init_from ------------------------------------------


def check_adapter(directory: str, cfg: DecoderConfig) -> None:
    """model.lora.init_from, checked before anything compiles: its two files,
    adapter_config.json against ``cfg.lora`` and every tensor's name and shape against
    the adapters ``cfg`` builds (from the file's header: no tensor is read)."""
    where = f"model.lora.init_from={directory!r}"
    _check_adapter_config(where, _adapter_config(where, directory), cfg.lora)
    try:
        header = _read_header(os.path.join(directory, ADAPTER_FILES[0]))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    found = {name: entry.shape for name, entry in header.items()}
    shapes = lora.trainable(_param_shapes(cfg), True)
    expected = {name: _hf_shape(_at(shapes, path).shape[1:], split)
                for name, path, _, split in _adapter_tensors(shapes, cfg)}
    missing = [n for n in expected if n not in found]
    saved = {n for n, key in SAVED_NAMES.items() if key in cfg.lora.saved_params}
    extra = sorted(set(found) - set(expected) - saved)
    if missing:
        raise ConfigError(f"{where}: {ADAPTER_FILES[0]} has no {missing[0]}, which the "
                          f"adapters of model.lora.target_modules on the base's "
                          f"{cfg.n_layers} layers need. Use the adapter trained on this base.")
    if extra:
        raise ConfigError(f"{where}: {ADAPTER_FILES[0]} holds {extra[0]}, which ndjax's "
                          "adapters do not have (LoRA's A and B of the blocks' projections "
                          "only). Use a plain LoRA adapter of this base.")
    for name, shape in expected.items():
        if found[name] != shape:
            raise ConfigError(f"{where}: {name} has shape {found[name]}, where this model's "
                              f"adapter has {shape} (model.lora.rank={cfg.lora.rank} and the "
                              "base's dims). Use the adapter trained on this base.")
    for name, key in SAVED_NAMES.items():
        if key in cfg.lora.saved_params:
            want = (cfg.vocab_size, cfg.dim)
            if name not in found or found[name] != want:
                raise ConfigError(
                    f"{where}: {ADAPTER_FILES[0]} has {name} of shape {found.get(name)}, where "
                    f"model.lora.modules_to_save needs {want} (the vocabulary with the tokens "
                    "the run adds): use the adapter trained with these tokens.")


def _adapter_config(where: str, directory: str) -> dict:
    """adapter_config.json of a PEFT adapter directory that has both files."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{where} is not a local directory: point it at a PEFT adapter "
                          f"directory ({ADAPTER_FILES[1]} and {ADAPTER_FILES[0]}, as PEFT's "
                          "save_pretrained and ndjax's adapter export write them).")
    for name in ADAPTER_FILES:
        if not os.path.isfile(os.path.join(directory, name)):
            # PEFT before 0.6 pickled the tensors; ndjax reads safetensors only.
            older = (" (an adapter_model.bin: load it with peft and save_pretrained it "
                     "again, which writes safetensors)" if name == ADAPTER_FILES[0] else "")
            raise ConfigError(f"{where} has no {name}: point it at a directory written by "
                              f"PEFT's save_pretrained{older}.")
    try:
        with open(os.path.join(directory, ADAPTER_FILES[1])) as f:
            config = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{where}: {ADAPTER_FILES[1]} is not JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {ADAPTER_FILES[1]} holds no JSON object; re-save the "
                          "adapter with PEFT's save_pretrained.")
    return config


def _check_adapter_config(where: str, config: dict, cfg: lora.LoraConfig) -> None:
    """PEFT's fields against model.lora, each mismatch naming the value to set. Fields
    that change nothing here pass (task_type, base_model_name_or_path...), and so does
    lora_dropout: it is how training goes on, not what the adapters hold."""
    said = f"{where}: {ADAPTER_FILES[1]} has"
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{said} peft_type={config.get('peft_type')!r}; ndjax loads LoRA "
                          "adapters only (peft_type 'LORA'): point it at one.")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{said} bias={config['bias']!r}; ndjax's adapters have no biases: "
                          "use an adapter trained with bias='none'.")
    for key in ("rank_pattern", "alpha_pattern"):  # a per-module alpha would load silently
        if config.get(key):
            raise ConfigError(f"{said} {key}={config[key]!r}; ndjax gives every adapter "
                              f"model.lora's one rank and alpha: use an adapter without {key}.")
    saved = config.get("modules_to_save") or []
    if sorted(saved) != sorted(cfg.saved):
        raise ConfigError(f"{said} modules_to_save={saved or None!r}, and "
                          f"model.lora.modules_to_save={','.join(cfg.saved)!r}: set "
                          f"model.lora.modules_to_save={','.join(saved)!r}.")
    theirs = _peft_targets(said, config.get("target_modules"))
    for field, key, ours, value in (
            ("rank", "r", cfg.rank, config.get("r")),
            ("alpha", "lora_alpha", cfg.alpha, config.get("lora_alpha")),
            ("use_rslora", "use_rslora", cfg.rslora, config.get("use_rslora", False)),
            ("target_modules", "target_modules", _target_names(cfg.targets),
             _target_names(theirs))):
        if value != ours:
            raise ConfigError(f"{said} {key}={value!r}, and model.lora.{field}={ours!r}: set "
                              f"model.lora.{field}={value!r}.")


def _peft_targets(said: str, value: Any) -> tuple[str, ...]:
    """adapter_config.json's target_modules (a list in any order, as PEFT saves its set)
    -> the ``lora.TARGETS`` keys."""
    listed = (",".join(value) if isinstance(value, list) and all(isinstance(v, str)
                                                                 for v in value) else value)
    targets = lora.parse_targets(listed) if isinstance(listed, str) and listed else None
    if not isinstance(targets, tuple):
        raise ConfigError(f"{said} target_modules={value!r}; ndjax's LoRA adapts the modules "
                          f"{', '.join(lora.TARGETS.values())} by name (no regular "
                          "expression): use an adapter of those.")
    return targets


def _target_names(targets: tuple[str, ...]) -> str:
    """``lora.TARGETS`` keys as model.lora.target_modules would say them."""
    if set(targets) == set(lora.TARGETS):
        return lora.ALL_LINEAR
    return ",".join(lora.TARGETS[t] for t in targets)


# PEFT's names of modules_to_save's tensors -> the top-level parameter each is.
SAVED_NAMES = {"base_model.model.model.embed_tokens.weight": "embed",
               "base_model.model.lm_head.weight": "lm_head"}


def load_saved_modules(directory: str, cfg: DecoderConfig, shapes: Any, shardings: Any
                       ) -> dict[str, jax.Array]:
    """The modules_to_save of a PEFT directory (``check_adapter``'s) as ndjax's top-level
    parameters, in ``shapes``' dtypes and ``shardings`` (``Experiment.param_shapes`` and
    ``state_sharding.params``), read one device shard at a time."""
    out = {}
    with safe_open(os.path.join(directory, ADAPTER_FILES[0]), framework="numpy") as f:
        for name, key in SAVED_NAMES.items():
            if key not in cfg.lora.saved_params:
                continue
            shape, sharding = shapes[key], shardings[key]
            split = None if key == "embed" else 1  # the LM head is stored (dim, vocab)
            part = sharding.shard_shape(shape.shape)

            def read(index, name=name, shape=shape, split=split, part=part):
                block = np.empty(part, shape.dtype)
                _fill(block, f.get_slice(name), shape.shape, split, index)
                return block
            out[key] = _put(shape.shape, sharding, read)
    return out


def load_adapter(directory: str, cfg: DecoderConfig, shapes: Any, shardings: Any) -> Any:
    """``export_adapter``'s inverse: a PEFT directory's adapters (``check_adapter``'s) as
    ndjax's adapter tree, in ``shapes``' dtype (float32, whatever the file stores).
    ``shapes``, ``shardings``: the adapters' part (``lora.split(..., True)[0]``) of
    ``Experiment.param_shapes`` and ``state_sharding.params``. Each array is made by
    ``jax.make_array_from_callback``: every process reads only its own devices' shards
    (the adapters are small, so ``_put``'s one-shard-at-a-time is not needed)."""
    names: dict[tuple[str, ...], tuple[int, list[str]]] = {}
    for name, path, _, split in _adapter_tensors(shapes, cfg):
        names.setdefault(path, (split, []))[1].append(name)  # in layer order
    with safe_open(os.path.join(directory, ADAPTER_FILES[0]), framework="numpy") as f:

        def load(path: Any, shape: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
            split, per_layer = names[tuple(str(k.key) for k in path)]

            def read(index: tuple[slice, ...]) -> np.ndarray:
                layers = range(shape.shape[0])[index[0]]
                out = np.empty((len(layers), *(len(range(n)[i]) for n, i in zip(
                    shape.shape[1:], index[1:], strict=True))), shape.dtype)
                for j, i in enumerate(layers):  # _fill casts to out's dtype
                    _fill(out[j], f.get_slice(per_layer[i]), shape.shape[1:], split, index[1:])
                return out
            return jax.make_array_from_callback(shape.shape, sharding, read)
        return jax.tree_util.tree_map_with_path(load, shapes, shardings)


def _write_metadata(tmp: str, plan: dict[str, list], itemsize: int, config: dict,
                    source: Checkpoint | None, tokenizer: Tokenizer | None) -> None:
    """config.json, the index of a sharded export, the source's generation files and
    the run's (else the source's) tokenizer files."""
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if len(plan) > 1:
        total = sum(math.prod(t[1]) for group in plan.values() for t in group) * itemsize
        index = {"metadata": {"total_size": total},
                 "weight_map": {t[0]: name for name, group in plan.items() for t in group}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    for file in sorted(os.listdir(source.directory)) if source else ():
        # A known run tokenizer replaces the source's: a byte run's ids are bytes, and a
        # run on another tokenizer.json must not ship the source's next to its weights.
        wanted = _MODEL_FILES.fullmatch(file) or (
            tokenizer is None and _TOKENIZER_FILES.fullmatch(file))
        if wanted and os.path.isfile(os.path.join(source.directory, file)):
            shutil.copy(os.path.join(source.directory, file), tmp)
    if tokenizer is None:
        return
    generation = os.path.join(tmp, "generation_config.json")
    if os.path.isfile(generation):
        _update_json(generation, lambda c: with_token_ids(c, tokenizer))
    if isinstance(tokenizer, HFTokenizer):
        _copy_tokenizer(tmp, tokenizer)


def _update_json(path: str, change: Callable[[dict], dict]) -> None:
    """Rewrites the JSON object in ``path`` as ``change(it)`` (only if that differs)."""
    try:
        with open(path, encoding="utf-8") as f:
            before = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        # At the end of a run: a copied file that is not JSON is left as it was, not
        # worth losing the export over.
        warnings.warn(f"{os.path.basename(path)} of the export is not JSON ({e}); its token "
                      "ids were left as they were.", stacklevel=2)
        return
    if not isinstance(before, dict):
        return
    after = change(before)
    if after != before:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(after, f, indent=2, sort_keys=True, ensure_ascii=False)


def _copy_tokenizer(tmp: str, tokenizer: HFTokenizer) -> None:
    """The run's tokenizer.json (under that name, whatever the run called it) and the
    files transformers keeps beside it; a tokenizer_config.json that names the run's
    special tokens where it did not (or did not exist), so AutoTokenizer knows them."""
    folder = os.path.dirname(os.path.abspath(tokenizer.name))
    for file in sorted(os.listdir(folder)):
        # The folder's own tokenizer.json is not the run's if the run named another file.
        if _TOKENIZER_FILES.fullmatch(file) and file != "tokenizer.json" \
                and os.path.isfile(os.path.join(folder, file)):
            shutil.copy(os.path.join(folder, file), tmp)
    if tokenizer.added:  # the file and the tokens the run added to it
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer.to_json())
    else:
        shutil.copy(tokenizer.name, os.path.join(tmp, "tokenizer.json"))
    config_path = os.path.join(tmp, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        # transformers 4 and 5 both load a bare tokenizer.json through this class.
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    named = {"eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id,
             "bos_token": tokenizer.bos_id}

    def fill(config: dict) -> dict:
        # Absent keys, and those the run's config named (data.eos_token, ...): a name the
        # file gives (even null) is otherwise the tokenizer's own.
        missing = {k: tokenizer.id_to_token(i) for k, i in named.items()
                   if (k not in config or k in tokenizer.chosen) and i is not None}
        return {**config, **missing}
    _update_json(config_path, fill)
