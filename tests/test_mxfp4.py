"""MXFP4 experts (GPT-OSS on the Hub, ndjax.models.mxfp4): numpy's dequantization equals
transformers' ``convert_moe_packed_tensors`` bit for bit (every scale and byte, float32,
bfloat16 and float16, both experts' shapes), the lazy slice's reads equal the whole
dequantization and read only the experts asked for, and a checkpoint's blocks + scales
open as the one tensor in its bf16 shape (``hf._read_headers``, ``hf._slice``), with the
refusals of pairs that are not whole and of other quantizations."""

import json
import os
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
from safetensors import safe_open
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from ndjax.models import mxfp4
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError

DTYPES = {"float32": (torch.float32, np.float32, np.uint32),
          "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16, np.uint16),
          "float16": (torch.float16, np.float16, np.uint16)}
HIDDEN, INTERMEDIATE, EXPERTS = 64, 96, 3
# Stored (E, rows, G, 16) for the bf16 layouts (E, hidden, 2 * intermediate) and
# (E, intermediate, hidden): rows are the output features, G * 32 the input ones.
SHAPES = {"gate_up_proj": (EXPERTS, 2 * INTERMEDIATE, HIDDEN // 32, 16),
          "down_proj": (EXPERTS, HIDDEN, INTERMEDIATE // 32, 16)}
LAYOUTS = {"gate_up_proj": (EXPERTS, HIDDEN, 2 * INTERMEDIATE),
           "down_proj": (EXPERTS, INTERMEDIATE, HIDDEN)}


def packed(shape, seed=0, scales=(0, 256)):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, shape, dtype=np.uint8),
            rng.integers(*scales, shape[:-1], dtype=np.uint8))


def transformers(blocks, scales, dtype):
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                     dtype=DTYPES[dtype][0])
    bits = torch.int32 if DTYPES[dtype][2] is np.uint32 else torch.int16
    return out.view(bits).numpy().view(DTYPES[dtype][2])


def bits(x, dtype):
    assert x.dtype == np.dtype(DTYPES[dtype][1])
    return np.ascontiguousarray(x).view(DTYPES[dtype][2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_scale_and_byte_as_transformers(dtype):
    """All 256 x 256 (scale, byte) pairs, scale 255 (ldexp's 2 ** 128) and 0 (subnormal
    2 ** -127 in float32) included, to the bit."""
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16),
                             (2, 256, 16, 16)).copy()
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 256, 1),
                             (2, 256, 16)).copy()
    want = transformers(blocks, scales, dtype)
    np.testing.assert_array_equal(bits(mxfp4.dequantize(blocks, scales, DTYPES[dtype][1]),
                                       dtype), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SHAPES)
def test_dequantize_as_transformers(name, dtype):
    """Random experts of both shapes: ``dequantize`` is transformers' result (its
    transpose included: the bf16 layout), ``dequantize_rows`` the same untransposed."""
    blocks, scales = packed(SHAPES[name], scales=(110, 140))
    want = transformers(blocks, scales, dtype)
    assert want.shape == LAYOUTS[name]
    np_dtype = DTYPES[dtype][1]
    np.testing.assert_array_equal(bits(mxfp4.dequantize(blocks, scales, np_dtype), dtype),
                                  want)
    rows = mxfp4.dequantize_rows(blocks, scales, np_dtype)
    np.testing.assert_array_equal(bits(rows, dtype), want.swapaxes(1, 2))
    assert mxfp4.dequantized_shape(blocks.shape, scales.shape) == LAYOUTS[name]


def test_nibble_order_and_scale_bias():
    """Byte 0x4B: low nibble 0xB (-1.5) first, high nibble 0x4 (2.0) second, times
    2 ** (scale - 127); transformers' table is ours."""
    assert mxfp4.FP4_VALUES == tuple(FP4_VALUES)
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x4B
    rows = mxfp4.dequantize_rows(blocks, np.full((1, 1), 129, np.uint8))
    assert rows.shape == (1, 32)
    np.testing.assert_array_equal(rows[0, :3], [-6.0, 8.0, 0.0])


def test_bad_arrays():
    blocks, scales = packed(SHAPES["down_proj"])
    with pytest.raises(ValueError, match="need scales of shape"):
        mxfp4.dequantize(blocks, scales[:, :, :1])
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks.astype(np.int32), scales)
    with pytest.raises(ValueError, match="are not MXFP4 experts'"):
        mxfp4.dequantized_shape((3, 64, 3, 8), (3, 64, 3))


def test_slice_reads_equal_the_whole(tmp_path, monkeypatch):
    """Leading-axis chunks (as hf._fill reads them), inner slices, steps, integers, from
    arrays and from a safetensors file: each read is the whole dequantization cut; a
    read decodes several chunks of experts when they pass _CHUNK_BYTES."""
    blocks, scales = packed(SHAPES["gate_up_proj"], seed=1, scales=(100, 150))
    whole = mxfp4.dequantize(blocks, scales)
    path = str(tmp_path / "x.safetensors")
    safetensors.numpy.save_file({"b": blocks, "s": scales}, path)
    monkeypatch.setattr(mxfp4, "_CHUNK_BYTES", 4 * HIDDEN * 2 * INTERMEDIATE)  # 1 expert
    keys = [(slice(0, 1),), (slice(1, 3),), (slice(None),), slice(2, 3),
            (slice(0, 3), slice(5, 40)),
            (slice(1, 2), slice(None), slice(7, 100)), (slice(0, 3, 2), slice(1, 64, 3)),
            (slice(None, None, -1), slice(40, 3, -5), slice(None, None, -2)),
            (1, slice(33, 34), 5), (Ellipsis, slice(3, 9)), (slice(2, 2),), ()]
    with safe_open(path, framework="numpy") as f:
        for source in ((blocks, scales), (f.get_slice("b"), f.get_slice("s"))):
            view = mxfp4.Mxfp4Slice(*source)
            assert view.get_shape() == list(LAYOUTS["gate_up_proj"])
            for key in keys:
                got = view[key]
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, whole[key], err_msg=str(key))


class Recorder:
    """A safetensors slice that records the leading-axis span of each read."""

    def __init__(self, array):
        self.array, self.reads = array, []

    def get_shape(self):
        return list(self.array.shape)

    def __getitem__(self, key):
        self.reads.append(range(self.array.shape[0])[key[0]])
        return self.array[key]


def test_slice_reads_only_the_experts_asked_for():
    blocks, scales = packed(SHAPES["down_proj"], seed=2)
    for lo, hi in ((0, 1), (1, 3), (2, 3)):
        b, s = Recorder(blocks), Recorder(scales)
        mxfp4.Mxfp4Slice(b, s)[lo:hi, :, 10:20]
        assert sorted(e for r in b.reads + s.reads for e in r) == sorted(2 * [*range(lo, hi)])


def write_packed(path, tensors):
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return str(path)


def test_checkpoint_pair_is_one_tensor(tmp_path):
    """_read_headers: gate_up_proj_blocks + _scales (uint8) is gate_up_proj in its bf16
    shape, beside an ordinary bf16 tensor; _slice reads it as the dequantization, the
    pair split over two files too (the scales' file opened by _slice)."""
    blocks, scales = packed(SHAPES["gate_up_proj"], seed=3, scales=(100, 150))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    bias = np.ones((EXPERTS, 2 * INTERMEDIATE), ml_dtypes.bfloat16)
    one = write_packed(tmp_path / "one.safetensors", {
        f"{name}_blocks": blocks, f"{name}_scales": scales, f"{name}_bias": bias})
    first = write_packed(tmp_path / "a.safetensors", {f"{name}_blocks": blocks,
                                                     f"{name}_bias": bias})
    second = write_packed(tmp_path / "b.safetensors", {f"{name}_scales": scales})
    whole = mxfp4.dequantize(blocks, scales)
    for entries in (hf._read_header(one), hf._read_headers([first, second])):
        assert sorted(entries) == [name, f"{name}_bias"]
        entry = entries[name]
        assert entry.shape == LAYOUTS["gate_up_proj"] and entry.path in (one, first)
        assert entries[f"{name}_bias"].mxfp4 is None
        with safe_open(entry.path, framework="numpy") as f:
            files = {entry.path: f}
            view = hf._slice(files, entry, name)
            assert view.get_shape() == list(entry.shape)
            np.testing.assert_array_equal(view[1:3, 4:50], whole[1:3, 4:50])
            np.testing.assert_array_equal(hf._slice(files, entries[f"{name}_bias"],
                                                    f"{name}_bias")[:], bias)


@pytest.mark.parametrize("tensors, message", [
    ({"x_blocks": np.zeros((2, 4, 2, 16), np.uint8)}, r"x_blocks \(U8\) has no x_scales"),
    ({"x_scales": np.zeros((2, 4, 2), np.uint8)}, r"x_scales \(U8\) has no x_blocks"),
    ({"x_blocks": np.zeros((2, 4, 2, 16), np.uint8),
      "x_scales": np.zeros((2, 4, 2), np.float32)}, r"x_blocks \(U8\) has no x_scales"),
    ({"x": np.zeros((2, 4), np.uint8)}, r"tensor x has dtype U8; ndjax reads"),
    ({"x_blocks": np.zeros((2, 4, 2, 16), np.uint8), "x_scales": np.zeros((2, 4, 3), np.uint8)},
     r"MXFP4 tensor x: blocks of shape \(2, 4, 2, 16\) and scales of shape \(2, 4, 3\)"),
    ({"x_blocks": np.zeros((2, 4, 2, 16), np.uint8), "x_scales": np.zeros((2, 4, 2), np.uint8),
      "x": np.zeros((2, 64, 4), np.float32)}, "both as it is and as MXFP4"),
    ({"x": np.zeros((2,), np.int32)}, r"dtype I32; ndjax reads \['BF16', 'F16', 'F32'\] and "
     "MXFP4 experts"),
])
def test_pairs_that_are_not_whole_are_refused(tmp_path, tensors, message):
    path = write_packed(tmp_path / "model.safetensors", tensors)
    with pytest.raises(ConfigError, match=message):
        hf._read_header(path)


@pytest.mark.parametrize("quant, error", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quant_method='bitsandbytes'; ndjax reads bf16, f32 and f16 weights and MXFP4 experts"),
    ({"quant_method": "fp8"}, "quant_method='fp8'"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
     "has no model.safetensors"),  # past the check: no weights here
])
def test_quantization_config(tmp_path, quant, error):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 256, "quantization_config": quant}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match=error):
        hf.open_checkpoint(str(tmp_path))


def test_load_params_reads_mxfp4_as_its_dequantization(tmp_path):
    """A tiny GPT-OSS saved by transformers, its experts replaced by random MXFP4 blocks and
    scales (the scales in a file of their own), loads on fsdp=4 x tensor=2 to the same
    parameters as the checkpoint holding ``dequantize``'s values in float32."""
    from conftest import tiny_config
    from transformers import GptOssConfig, GptOssForCausalLM

    from ndjax.experiment import Experiment

    torch.manual_seed(0)
    GptOssForCausalLM(GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
    )).save_pretrained(tmp_path / "source")
    tensors = safetensors.numpy.load_file(str(tmp_path / "source" / "model.safetensors"))
    with open(tmp_path / "source" / "config.json") as f:
        config = json.load(f)
    rng = np.random.default_rng(0)
    quantized, plain = dict(tensors), dict(tensors)
    for name, x in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = x.shape
            blocks = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
            scales = rng.integers(120, 128, blocks.shape[:-1], dtype=np.uint8)
            del quantized[name]
            quantized.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
            plain[name] = mxfp4.dequantize(blocks, scales)
    files = {"model-00001-of-00002.safetensors": {
                 k: v for k, v in quantized.items() if not k.endswith("_scales")},
             "model-00002-of-00002.safetensors": {
                 k: v for k, v in quantized.items() if k.endswith("_scales")}}
    for directory, config_json, written in (
            ("mxfp4", {**config, "quantization_config": {"quant_method": "mxfp4"}}, files),
            ("plain", config, {"model.safetensors": plain})):
        os.makedirs(tmp_path / directory)
        with open(tmp_path / directory / "config.json", "w") as f:
            json.dump(config_json, f)
        for file, held in written.items():
            write_packed(tmp_path / directory / file, held)
        if len(written) > 1:
            with open(tmp_path / directory / "model.safetensors.index.json", "w") as f:
                json.dump({"weight_map": {k: file for file, held in written.items()
                                          for k in held}}, f)

    def load(directory):
        c = tiny_config(mesh=dict(fsdp=4, tensor=2))
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                      "rope_theta"):
            c.model[field] = None
        c.model.family, c.model.init_from = "gpt_oss", str(tmp_path / directory)
        exp = Experiment.from_config(c)
        assert exp.checkpoint.tensors["model.layers.1.mlp.experts.down_proj"].mxfp4 or \
            directory == "plain"
        return hf.load_params(exp.checkpoint, exp.param_shapes, exp.state_sharding.params)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = load("mxfp4"), load("plain")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
