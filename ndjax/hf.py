"""Hugging Face Llama checkpoints in and out.

Import: ``open_checkpoint`` checks a local directory (``config.json`` plus one
or more ``.safetensors`` files) before anything compiles and reads the model's
dims from ``config.json``; ``load_params`` then builds every parameter directly
in its target sharding, each device's shard read from the memory-mapped file.

Export: ``export`` writes a directory that ``transformers`` loads, one tensor
at a time (gathered to the host per Hugging Face tensor, i.e. per layer), into a
temporary directory renamed into place at the end.

The files are read and written here rather than with the ``safetensors``
package: its numpy reader rejects bfloat16 (the dtype Llama checkpoints ship
in) and its writer wants every tensor in memory at once. The format is a
little-endian u64 header length, a JSON header (dtype, shape, byte offsets per
tensor) and the raw bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import struct
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from ndjax.config import default_config
from ndjax.errors import ConfigError
from ndjax.models import llama

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(jnp.bfloat16)}
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# Hugging Face's own shard size before transformers 5 (which went to 50GB).
SHARD_BYTES = 5 * 10**9
# Files of the source directory that a Hugging Face user expects next to the weights.
_COPIED = re.compile(r"(tokenizer|special_tokens_map|added_tokens|generation_config|"
                     r"chat_template)[\w.-]*")
# Left in old checkpoints by transformers < 4.31; recomputed from config.json.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# ndjax path -> (Hugging Face name, split). ``split`` = None: same layout. Else
# the HF weight is a Linear's (out, in) matrix and the ndjax parameter is its
# transpose with in = shape[:split] and out = shape[split:] (heads x head_dim
# flattened into one axis: rotate-half RoPE makes this a pure reshape).
_TOP = {("embed",): ("model.embed_tokens.weight", None),
        ("final_norm", "scale"): ("model.norm.weight", None),
        ("lm_head",): ("lm_head.weight", 1)}
_LAYER = {("attn", "wq"): ("self_attn.q_proj.weight", 1),
          ("attn", "wk"): ("self_attn.k_proj.weight", 1),
          ("attn", "wv"): ("self_attn.v_proj.weight", 1),
          ("attn", "wo"): ("self_attn.o_proj.weight", 2),
          ("attn_norm", "scale"): ("input_layernorm.weight", None),
          ("mlp_norm", "scale"): ("post_attention_layernorm.weight", None),
          ("mlp", "w_gate"): ("mlp.gate_proj.weight", 1),
          ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
          ("mlp", "w_down"): ("mlp.down_proj.weight", 1)}


def _hf_shape(shape: tuple[int, ...], split: int | None) -> tuple[int, ...]:
    return shape if split is None else (math.prod(shape[split:]), math.prod(shape[:split]))


# ----- safetensors files --------------------------------------------------------


class _File:
    """One .safetensors file: its header now, its data memory-mapped on first use."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n)) if 8 + n <= size else None
        except (struct.error, ValueError, UnicodeDecodeError):
            header = None
        if not isinstance(header, dict):
            raise ConfigError(f"{path} is not a safetensors file (bad header). Re-save it with "
                              "transformers' save_pretrained.")
        header.pop("__metadata__", None)
        self.start = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        for name, e in header.items():
            code = e.get("dtype") if isinstance(e, dict) else None
            if code not in _DTYPES:
                raise ConfigError(f"{path}: tensor {name} has dtype {code}; ndjax reads "
                                  f"{sorted(_DTYPES)}. Convert the checkpoint first.")
            try:
                shape, (begin, end) = tuple(int(d) for d in e["shape"]), e["data_offsets"]
                ok = end - begin == math.prod(shape) * _DTYPES[code].itemsize
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok or self.start + end > size:
                raise ConfigError(f"{path}: tensor {name} has a byte range that does not match "
                                  "its shape or the file size; the file is damaged.")
            self.entries[name] = (_DTYPES[code], shape, begin)
        self._map: np.memmap | None = None

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view into the mapped file: nothing is read until it is indexed."""
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        dtype, shape, begin = self.entries[name]
        data = self._map[self.start + begin:self.start + begin + math.prod(shape) * dtype.itemsize]
        return data.view(dtype).reshape(shape)


# ----- import ---------------------------------------------------------------------


@dataclasses.dataclass
class Checkpoint:
    """A checked local Hugging Face Llama directory."""

    directory: str
    config: dict          # config.json as read
    dims: dict            # llama.LlamaConfig fields from config.json
    files: dict[str, _File]  # Hugging Face tensor name -> the file that holds it

    def view(self, name: str, shape: tuple[int, ...], split: int | None) -> np.ndarray:
        """The HF tensor ``name`` as a view in ndjax layout (``shape``); no copy."""
        x = self.files[name].tensor(name)
        # copy=False: a layout the view cannot express must fail, not read the whole tensor.
        return x if split is None else x.T.reshape(shape, copy=False)


def _field(where: str, key: str, fix: str = "") -> ConfigError:
    return ConfigError(f"model.init_from={where!r}: config.json {key}. {fix}".strip())


def _rope(c: dict, where: str) -> tuple[float, llama.RopeScaling | None]:
    # transformers 5 writes rope_parameters (theta inside); 4.x writes rope_theta and
    # rope_scaling at the top level. Like transformers 5, prefer rope_scaling.
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", c.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _field(where, f"partial_rotary_factor={params['partial_rotary_factor']}",
                     "ndjax rotates the whole head; only 1.0 is supported.")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _field(where, f"rope type {kind!r} is not supported",
                     "ndjax implements default and llama3 rotary embeddings.")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise _field(where, f"llama3 rope scaling lacks {missing}", "Add them to config.json.")
    original = params.get("original_max_position_embeddings",
                          c.get("max_position_embeddings", 2048))
    return theta, llama.RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original))


def _dims(c: dict, where: str) -> dict:
    """LlamaConfig fields from config.json, with transformers' defaults for absent ones."""
    archs = c.get("architectures") or ["LlamaForCausalLM"]
    if c.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
        raise _field(where, f"describes model_type={c.get('model_type')!r}, architectures="
                     f"{archs}", "ndjax imports LlamaForCausalLM checkpoints only.")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if c.get(key, want) != want:
            raise _field(where, f"{key}={c[key]!r}", f"ndjax's Llama has {key}={want!r}.")
    ints = {}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if not isinstance(c.get(key), int) or c[key] < 1:
            raise _field(where, f"{key}={c.get(key)!r} must be a positive int",
                         "Fix config.json.")
        ints[key] = c[key]
    heads = ints["num_attention_heads"]
    theta, scaling = _rope(c, where)
    return dict(vocab_size=ints["vocab_size"], dim=ints["hidden_size"],
                n_layers=ints["num_hidden_layers"], n_heads=heads,
                n_kv_heads=c.get("num_key_value_heads") or heads,
                ffn_dim=ints["intermediate_size"],
                head_dim=c.get("head_dim") or ints["hidden_size"] // heads, rope_theta=theta,
                rope_scaling=scaling, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)))


def _expected_shapes(d: dict) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a LlamaForCausalLM with these dims has, with its shape."""
    v, dim, hd, f = d["vocab_size"], d["dim"], d["head_dim"], d["ffn_dim"]
    q, kv = d["n_heads"] * hd, d["n_kv_heads"] * hd
    out = {"model.embed_tokens.weight": (v, dim), "model.norm.weight": (dim,)}
    if not d["tie_embeddings"]:
        out["lm_head.weight"] = (v, dim)
    per_layer = {"self_attn.q_proj.weight": (q, dim), "self_attn.k_proj.weight": (kv, dim),
                 "self_attn.v_proj.weight": (kv, dim), "self_attn.o_proj.weight": (dim, q),
                 "input_layernorm.weight": (dim,), "post_attention_layernorm.weight": (dim,),
                 "mlp.gate_proj.weight": (f, dim), "mlp.up_proj.weight": (f, dim),
                 "mlp.down_proj.weight": (dim, f)}
    for i in range(d["n_layers"]):
        out.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
    return out


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


def open_checkpoint(directory: str) -> Checkpoint:
    """Checks a local HF Llama directory (config, files, every tensor's shape); reads no data."""
    if not os.path.isdir(directory):
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", directory) and not os.path.exists(directory)
        fix = (f" If {directory!r} is a Hugging Face hub id: ndjax does not download, so run "
               f"`hf download {directory} --local-dir DIR` first and pass "
               "--config.model.init_from=DIR." if hub else "")
        raise ConfigError(f"model.init_from={directory!r} is not a local directory.{fix}")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.init_from={directory!r} has no config.json. Point it at a "
                          "directory written by transformers' save_pretrained.")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as e:
        raise ConfigError(f"model.init_from={directory!r}: config.json is not JSON ({e}).") from e
    dims = _dims(config, directory)
    files: dict[str, _File] = {}
    for file in map(_File, _weight_files(directory)):
        files.update(dict.fromkeys(file.entries, file))
    expected = _expected_shapes(dims)
    missing = sorted(set(expected) - set(files))
    extra = sorted(n for n in set(files) - set(expected) if not _IGNORED.fullmatch(n)
                   and not (n == "lm_head.weight" and dims["tie_embeddings"]))
    if missing or extra:
        raise ConfigError(
            f"model.init_from={directory!r}: the weights do not match config.json (e.g. "
            f"num_hidden_layers={dims['n_layers']}, tie_word_embeddings="
            f"{dims['tie_embeddings']}): missing {missing[:4]}, unexpected {extra[:4]}. Use the "
            "config.json that was saved with these weights.")
    for name, shape in expected.items():
        actual = files[name].entries[name][1]
        if actual != shape:
            raise ConfigError(
                f"model.init_from={directory!r}: tensor {name} has shape {actual}, but "
                f"config.json implies {shape} (hidden_size={dims['dim']}, intermediate_size="
                f"{dims['ffn_dim']}, heads={dims['n_heads']}, kv heads={dims['n_kv_heads']}, "
                f"head_dim={dims['head_dim']}, vocab_size={dims['vocab_size']}). Use the "
                "config.json that was saved with these weights.")
    return Checkpoint(directory, config, dims, files)


def override_dims(model: ml_collections.ConfigDict, preset_dims: dict, ckpt: Checkpoint
                  ) -> dict:
    """The checkpoint's dims, with a warning naming each config field they override."""
    fields = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim",
              "rope_theta", "tie_embeddings")
    asked = [(f"model.{f}={model[f]!r}", f, model[f]) for f in fields if model[f] is not None]
    # A preset other than the default was chosen on purpose: say so if it is ignored.
    if model.preset != default_config().model.preset:
        asked += [(f"{f}={preset_dims[f]!r} of model.preset={model.preset!r}", f, preset_dims[f])
                  for f in fields if model[f] is None and f in preset_dims]
    changed = [f"{label} -> {ckpt.dims[f]!r}" for label, f, value in asked
               if value != ckpt.dims[f]]
    if changed:
        warnings.warn(f"model.init_from={ckpt.directory!r}: config.json overrides "
                      f"{', '.join(changed)}. Drop those fields: the checkpoint sets the model.",
                      stacklevel=3)
    return dict(ckpt.dims)


def check_tokenizer(config: ml_collections.ConfigDict, ckpt: Checkpoint) -> None:
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


def load_params(ckpt: Checkpoint, shapes: Any, shardings: Any) -> Any:
    """The checkpoint as an ndjax parameter dict, every array created in its sharding.

    ``shapes`` and ``shardings`` are the Experiment's ``param_shapes`` and
    ``state_sharding.params``. Each device's shard is read from the memory-mapped
    file; for the stacked layer parameters, only the layers in that shard. Values
    are converted to the parameters' dtype (``shapes``), rounding to nearest even.
    """
    def load(path, shape, sharding):
        dtype = np.dtype(shape.dtype)
        keys = tuple(str(k.key) for k in path)
        if keys[0] != "layers":
            name, split = _TOP[keys]
            view = ckpt.view(name, shape.shape, split)
            # C order (the device layout): a transposed view would otherwise give a
            # Fortran-ordered shard that the transfer has to copy once more.
            return _put(shape.shape, sharding,
                        lambda index: np.asarray(view[index], dtype, order="C"))
        hf_name, split = _LAYER[keys[1:]]
        per_layer = shape.shape[1:]

        def read(index):
            layers = range(shape.shape[0])[index[0]]
            out = np.empty((len(layers), *sharding.shard_shape(shape.shape)[1:]), dtype)
            for j, i in enumerate(layers):
                out[j] = ckpt.view(f"model.layers.{i}.{hf_name}", per_layer, split)[index[1:]]
            return out

        return _put(shape.shape, sharding, read)

    return jax.tree_util.tree_map_with_path(load, shapes, shardings)


# ----- export ---------------------------------------------------------------------


def check_export(export: ml_collections.ConfigDict) -> None:
    """Up-front checks of the export fields, so a run never fails at its end."""
    if export.dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export.dtype={export.dtype!r}: choose one of {sorted(EXPORT_DTYPES)}.")
    out = export.hf_dir
    if out is not None and (os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out))):
        raise ConfigError(f"export.hf_dir={out!r} exists and is not empty; ndjax will not "
                          "overwrite it. Remove it or choose a new directory.")


def hf_config(cfg: llama.LlamaConfig, dtype: str, source: dict | None = None,
              max_position_embeddings: int | None = None) -> dict:
    """config.json for ``cfg``; fields ndjax does not model (token ids, ...) from ``source``."""
    out = {k: v for k, v in (source or {}).items() if k not in (
        "rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype",
        "transformers_version", "auto_map", "quantization_config", "_name_or_path")}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(rope_type="llama3", **dataclasses.asdict(cfg.rope_scaling))
    default_positions = (int(cfg.rope_scaling.original_max_position_embeddings
                             * cfg.rope_scaling.factor) if cfg.rope_scaling else 8192)
    out.update(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.hd,
        hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False,
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta + rope_scaling.
        rope_theta=cfg.rope_theta, rope_parameters=rope,
        rope_scaling=None if cfg.rope_scaling is None else dict(rope),
        dtype=dtype, torch_dtype=dtype)
    out.setdefault("max_position_embeddings", max_position_embeddings or default_positions)
    # transformers' LlamaConfig defaults.
    for key, value in (("bos_token_id", 1), ("eos_token_id", 2), ("initializer_range", 0.02),
                       ("use_cache", True)):
        out.setdefault(key, value)
    return out


def _host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _tensors(params: Any) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """(HF name, HF shape, () -> host array in HF layout), in HF's order."""
    def entry(name, x, split, layer=None):
        shape = x.shape if layer is None else x.shape[1:]

        def get():
            a = _host(x if layer is None else x[layer])  # one layer on the host at a time
            return a if split is None else a.reshape(_hf_shape(shape, split)[::-1]).T
        return name, _hf_shape(shape, split), get

    yield entry("model.embed_tokens.weight", params["embed"], None)
    layers = params["layers"]
    for i in range(layers["attn"]["wq"].shape[0]):
        for (group, leaf), (name, split) in _LAYER.items():
            yield entry(f"model.layers.{i}.{name}", layers[group][leaf], split, i)
    yield entry("model.norm.weight", params["final_norm"]["scale"], None)
    if "lm_head" in params:
        yield entry("lm_head.weight", params["lm_head"], 1)


def _write_file(path: str | None, tensors: list, code: str) -> None:
    """One safetensors file, streamed tensor by tensor (``path`` None: gather only)."""
    dtype = _DTYPES[code]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the data 8-byte aligned, as safetensors does
    with open(path, "wb") if path else contextlib.nullcontext() as f:
        if f:
            f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, get in tensors:
            a = get().astype(dtype, order="C")  # every process joins the gather
            assert a.shape == shape, (name, a.shape, shape)
            if f:
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
        if f:
            f.flush()
            os.fsync(f.fileno())


def export(params: Any, cfg: llama.LlamaConfig, out_dir: str, dtype: str = "bfloat16", *,
           source: Checkpoint | None = None, max_position_embeddings: int | None = None,
           shard_bytes: int = SHARD_BYTES) -> None:
    """Writes ``params`` as a Hugging Face LlamaForCausalLM directory, atomically.

    All processes must call this (the gathers are collective); process 0 writes.
    Tensors are gathered one at a time (stacked parameters one layer at a time)
    and streamed to disk, so host memory stays at about one tensor. Tokenizer and
    generation files of ``source`` are copied along.
    """
    code = EXPORT_DTYPES[dtype]
    tensors = list(_tensors(params))
    groups: list[list] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t[1]) * _DTYPES[code].itemsize
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])

    writer = jax.process_index() == 0
    out_dir = os.path.abspath(out_dir)
    tmp = None
    if writer:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-",
                               dir=os.path.dirname(out_dir))
    try:
        for name, group in zip(names, groups):
            _write_file(tmp and os.path.join(tmp, name), group, code)
        if writer:
            config = hf_config(cfg, dtype, source and source.config, max_position_embeddings)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
            if len(groups) > 1:
                index = {"metadata": {"total_size": sum(math.prod(t[1]) for t in tensors)
                                      * _DTYPES[code].itemsize},
                         "weight_map": {t[0]: n for n, g in zip(names, groups) for t in g}}
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump(index, f, indent=2)
            for file in sorted(os.listdir(source.directory)) if source else ():
                if _COPIED.fullmatch(file) and os.path.isfile(os.path.join(source.directory, file)):
                    shutil.copy(os.path.join(source.directory, file), tmp)
            os.rename(tmp, out_dir)  # replaces an empty directory; fails on a non-empty one
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if jax.process_count() > 1:  # the others wait until the directory is in place
        multihost_utils.sync_global_devices("ndjax.hf.export")
