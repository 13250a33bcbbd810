"""Hugging Face checkpoints in and out, against transformers' LlamaForCausalLM.

Small random models are built with transformers + torch on the CPU (no
downloads), saved with save_pretrained, loaded into ndjax and compared on the
same tokens in float32.

Tolerance: logits max abs difference <= 1e-4. Both sides compute in float32
from bit-identical weights and differ only in the order of reductions (~1e-6
here, on logits with a spread of ~1); a wrong layout (a transposed head, swapped
norms, unscaled RoPE) moves logits by ~1e-1. Weights that only pass through
(import -> export) must come back bit-identical.
"""

import copy
import json
import math
import os
import subprocess
import sys
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_config
from data_files import data_config, texts, write_text, write_tokenizer
from safetensors import safe_open
from test_tokenizer_files import QWEN, write_hf_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ndjax.data.tokenizers import load_tokenizer
from ndjax.experiment import Experiment
from ndjax.models import registry
from ndjax.parallel import rules as rules_lib
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.training.loop import train
from ndjax.verbs.export import export_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
            # Weights ~10x the default scale, so that logits spread over ~1 and a
            # layout mistake cannot hide under the tolerance.
            initializer_range=0.2)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   # Small, so that the scaling changes the frequencies of head_dim 8.
                   original_max_position_embeddings=16)
CASES = {
    # 2 kv heads for 8 query heads, untied, llama3 rope scaling with a non-default theta.
    "gqa_llama3": dict(rope_theta=500_000.0, rope_scaling=LLAMA3_ROPE),
    "mqa_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    # Odd sizes that still divide fsdp=4 x tensor=2; head_dim != hidden / heads.
    "odd_sizes": dict(vocab_size=264, intermediate_size=136, hidden_size=96,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                      num_hidden_layers=3),
}
FSDP_TP = dict(fsdp=4, tensor=2)
# One kv head cannot be split over tensor=2: replicate it, as Megatron does for MQA.
KV_REPLICATED = tuple((name, None if name in ("kv_heads", "act_kv_heads") else axes)
                      for name, axes in rules_lib.PRESETS["default"])
# Shards what the presets never do, so that import meets it too: the stacked layers
# over fsdp, head_dim (inside q/k/v's rows and o's columns of the HF matrices) and
# the norms over tensor.
ODD_SHARDING = tuple((name, {"layers": "fsdp", "embed": None, "q_heads": None,
                             "kv_heads": None, "head_dim": "tensor", "norm": "tensor"
                             }.get(name, axes))
                     for name, axes in rules_lib.PRESETS["default"])
B, S = 4, 32  # B divides fsdp=4


def make_hf(directory, seed=0, dtype=torch.float32, max_shard_size=None, **overrides):
    """A random LlamaForCausalLM saved to ``directory``; returns the model (float32)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():  # transformers starts norms at 1: make swapped norms visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.to(dtype).save_pretrained(directory, **kwargs)
    return model.float()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def tokens(vocab, seed=1):
    t = np.random.default_rng(seed).integers(0, vocab, (B, S)).astype(np.int32)
    t[0, :2] = vocab - 1  # the last rows of an odd-sized, vocab-sharded embedding
    return t


def config_for(directory, mesh=None, rules="default", **export):
    """A config that takes every model dim from ``directory`` (none set by hand)."""
    c = tiny_config(mesh=mesh, rules=rules)
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "rope_theta"):
        c.model[field] = None
    c.model.init_from = str(directory)
    c.export.update(export)
    return c


def ndjax_logits(exp, params, toks):
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), toks.shape)
    with rules_lib.use(exp.rules):
        out = jax.jit(exp.apply)(params, toks, positions, np.ones_like(toks))
    return np.asarray(out)


def load(exp):
    return hf.load_params(exp.checkpoint, exp.param_shapes, exp.state_sharding.params)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Case name -> (directory, float32 torch model), built once per module."""
    cache = {}

    def get(case):
        if case not in cache:
            directory = tmp_path_factory.mktemp(case)
            cache[case] = (directory, make_hf(directory, **CASES[case]))
        return cache[case]
    return get


@pytest.mark.parametrize("mesh", ["fsdp_tp", "one_device"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(saved, case, mesh):
    directory, model = saved(case)
    if mesh == "fsdp_tp":
        # mqa_tied: one kv head on tensor=2, replicated on both shards.
        exp = Experiment.from_config(config_for(directory, FSDP_TP))
        assert exp.state_sharding.params["layers"]["attn"]["wq"].spec == jax.P(
            None, "fsdp", "tensor")
    else:
        exp = Experiment.from_config(config_for(directory), jax.devices()[:1])
    toks = tokens(model.config.vocab_size)
    ref = hf_logits(model, toks)
    assert ref.std() > 0.5  # logits with a real spread, or the tolerance would be loose
    np.testing.assert_allclose(ndjax_logits(exp, load(exp), toks), ref, rtol=0, atol=1e-4)


def test_dims_and_rope_come_from_config_json(saved):
    directory, _ = saved("gqa_llama3")
    cfg = Experiment.from_config(config_for(directory, FSDP_TP)).model_cfg
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim,
            cfg.hd, cfg.rope_theta, cfg.tie_embeddings) == (256, 64, 2, 8, 2, 128, 8, 5e5, False)
    assert cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 16
    assert cfg.rms_norm_eps == 1e-6  # transformers' default, as saved


def test_config_fields_are_overridden_with_a_warning(saved):
    directory, _ = saved("gqa_llama3")
    c = config_for(directory, FSDP_TP)
    c.model.dim, c.model.n_heads = 128, 8  # dim disagrees, n_heads agrees
    with pytest.warns(UserWarning, match=r"overrides model.dim=128 -> 64\. Drop") as record:
        exp = Experiment.from_config(c)
    assert "n_heads" not in str(record[0].message)
    assert exp.model_cfg.dim == 64


def test_byte_tokenizer_with_a_checkpoint_tokenizer_warns(tmp_path):
    make_hf(tmp_path, **CASES["odd_sizes"])  # vocab 264 holds the byte tokenizer's 259 ids
    (tmp_path / "tokenizer.json").write_text("{}")
    c = config_for(tmp_path, FSDP_TP)
    c.data.source = "builtin"
    with pytest.warns(UserWarning, match=r"has a tokenizer.json, but data.tokenizer='byte'.*"
                                         r"--config.data.tokenizer=.*tokenizer.json"):
        Experiment.from_config(c)


def test_sharded_safetensors_input(tmp_path):
    model = make_hf(tmp_path, max_shard_size="40KB")
    shards = [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").exists()
    exp = Experiment.from_config(config_for(tmp_path, FSDP_TP))
    toks = tokens(256)
    np.testing.assert_allclose(ndjax_logits(exp, load(exp), toks), hf_logits(model, toks),
                               rtol=0, atol=1e-4)


def expected_params(model, shapes, cfg):
    """The ndjax parameters a transformers model's weights make (the family's
    name/layout map)."""
    weights = {k: v.float().numpy() for k, v in model.state_dict().items()}
    top, per_layer = registry.of(cfg).hf_names(cfg)

    def layout(name, shape, split):
        return weights[name] if split is None else weights[name].T.reshape(shape)

    def one(path, shape):
        keys = tuple(str(k.key) for k in path)
        if keys[0] != "layers":
            name, split = top[keys]
            return layout(name, shape.shape, split)
        name, split = per_layer[keys[1:]]
        return np.stack([layout(f"model.layers.{i}.{name}", shape.shape[1:], split)
                         for i in range(shape.shape[0])])
    return jax.tree_util.tree_map_with_path(one, shapes)


@pytest.mark.parametrize("mesh, rules", [(FSDP_TP, "default"),
                                         (dict(fsdp=2, tensor=4), ODD_SHARDING)],
                         ids=["fsdp_tp", "odd_sharding"])
def test_bf16_shards_from_several_files(tmp_path, mesh, rules):
    """Each device's shard, read from a bfloat16 checkpoint split over files, holds
    exactly the checkpoint's values (bfloat16 -> float32 is exact)."""
    model = make_hf(tmp_path, dtype=torch.bfloat16, max_shard_size="40KB")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 3
    exp = Experiment.from_config(config_for(tmp_path, mesh, rules))
    if rules is ODD_SHARDING:
        assert exp.state_sharding.params["layers"]["attn"]["wq"].spec == jax.P(
            "fsdp", None, None, "tensor")
    params = load(exp)
    expected = expected_params(model, exp.param_shapes, exp.model_cfg)
    for (path, got), want, sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                           jax.tree.leaves(expected),
                                           jax.tree.leaves(exp.state_sharding.params)):
        assert got.sharding == sharding and got.dtype == np.float32, path
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))


def test_export_in_files_of_max_shard_size(saved, tmp_path):
    """export.max_shard_size (train.py's path, steps=0): several files, filled in order up
    to the limit, named and indexed as transformers does; transformers loads them back
    with the same weights."""
    directory, model = saved("gqa_llama3")
    out = tmp_path / "out"
    c = config_for(directory, FSDP_TP, hf_dir=str(out), dtype="float32", max_shard_size="100KB")
    c.train.steps = 0
    c.log.tensorboard = False
    train(c, str(tmp_path / "w"), verbose=False)
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    sizes = {}
    for name in files:
        with safe_open(out / name, framework="numpy") as f:
            sizes[name] = [math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()]
    # Full files: at most the limit, unless one tensor alone is larger.
    assert all(sum(s) <= 100_000 or len(s) == 1 for s in sizes.values()), sizes
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(map(sum, sizes.values())) == 4 * sum(
        p.numel() for p in model.parameters())
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_same_weights(loaded, model)


@pytest.mark.parametrize("value, size", [(1234, 1234), ("5GB", 5 * 10**9),
                                         ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
                                         ("40kb", 40_000), ("1.5MB", 1_500_000)])
def test_max_shard_size_units(value, size):
    assert hf.shard_size(value) == size


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("case, mesh", [("gqa_llama3", FSDP_TP), ("mqa_tied", FSDP_TP),
                                        ("gqa_llama3", dict(fsdp=2, tensor=4)),
                                        ("mqa_tied", dict(fsdp=2, tensor=4))])
def test_round_trip_through_transformers(saved, tmp_path, case, mesh):
    """Import, export, load in transformers: the same weights. On tensor=4 the 2 kv
    heads (and on tensor=2 MQA's one) are replicated in memory, stored once on disk."""
    directory, model = saved(case)
    exp = Experiment.from_config(config_for(directory, mesh))
    state = exp.init_state()  # the train path: parameters loaded, optimizer state fresh
    assert int(state.step) == 0
    assert jax.tree.leaves(state.opt_state)[1].sharding == exp.state_sharding.params["embed"]
    out = tmp_path / "out"
    # A small shard size: the sharded output format (with its index) is covered too.
    hf.export(state.params, exp.model_cfg, str(out), "float32", source=exp.checkpoint,
              shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").exists()
    assert (out / "generation_config.json").exists()  # copied from the source
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp dir left
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_same_weights(loaded, model)
    toks = tokens(model.config.vocab_size)
    np.testing.assert_allclose(hf_logits(loaded, toks), hf_logits(model, toks), rtol=0,
                               atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((directory / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "rms_norm_eps", "head_dim",
                "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id",
                "max_position_embeddings", "architectures", "model_type"):
        assert config[key] == source[key], key
    assert config["rope_theta"] == source["rope_parameters"]["rope_theta"]
    assert config["dtype"] == "float32"


def test_bfloat16_export_without_source(saved, tmp_path):
    """Export with no source config.json (as after training from scratch), in bfloat16,
    into an existing empty directory."""
    directory, model = saved("mqa_tied")
    exp = Experiment.from_config(config_for(directory, FSDP_TP, KV_REPLICATED))
    params = load(exp)
    out = tmp_path / "out"
    out.mkdir()
    hf.export(params, exp.model_cfg, str(out), "bfloat16")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert loaded.dtype == torch.bfloat16
    assert loaded.config.tie_word_embeddings and loaded.config.bos_token_id == 1
    # The source's weights rounded to bfloat16 (round-to-nearest-even on both sides).
    assert_same_weights(loaded, copy.deepcopy(model).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bf16_parameters_in_and_out(saved, tmp_path, dtype):
    """Import into model.param_dtype=bfloat16 rounds the float32 checkpoint to
    nearest even (as torch does); export writes those bf16 values, exactly, in
    either file dtype."""
    directory, model = saved("gqa_llama3")
    c = config_for(directory, FSDP_TP)
    c.model.param_dtype = "bfloat16"
    exp = Experiment.from_config(c)
    state = exp.init_state()  # the train path: loaded, moments fresh
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {np.dtype(jnp.bfloat16)}
    hf.export(state.params, exp.model_cfg, str(tmp_path / "out"), dtype)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    rounded = copy.deepcopy(model).to(torch.bfloat16)
    assert_same_weights(loaded, rounded if dtype == "bfloat16" else rounded.float())


def test_host_memory_is_one_shard(tmp_path):
    """How host memory was checked: tracemalloc sees every numpy allocation.

    While loading, the peak less what is still allocated at the end (the result's
    Python objects, and host arrays the CPU backend adopted as device buffers:
    device memory, on CPU) must stay within the largest per-device shard of one
    parameter plus 64 KiB, on a model >10x (8 devices) and >4x (one device) that
    shard. Holding a tensor's shards at once (as jax.make_array_from_callback
    does), reading whole tensors per device, or leaving host copies to the garbage
    collector would break it; today it is one shard + ~13 KiB.
    """
    model = make_hf(tmp_path, dtype=torch.bfloat16, vocab_size=1024, hidden_size=256,
                    intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4)
    for mesh, devices, ratio in ((FSDP_TP, None, 10), (None, jax.devices()[:1], 4)):
        exp = Experiment.from_config(config_for(tmp_path, mesh), devices)
        shapes = jax.tree.leaves(exp.param_shapes)
        model_bytes = sum(math.prod(s.shape) * 4 for s in shapes)
        shard = max(math.prod(sh.shard_shape(s.shape)) * 4
                    for s, sh in zip(shapes, jax.tree.leaves(exp.state_sharding.params)))
        assert model_bytes > ratio * shard
        tracemalloc.start()
        try:
            params = jax.block_until_ready(load(exp))
            kept, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak - kept <= shard + 64 * 1024, (mesh, peak, kept, shard, model_bytes)
        # bfloat16 on disk -> float32 parameters, exactly.
        np.testing.assert_array_equal(
            np.asarray(params["layers"]["mlp"]["w_down"][3]),
            model.model.layers[3].mlp.down_proj.weight.detach().numpy().T)


def test_steps_0_is_a_round_trip(saved, tmp_path):
    directory, model = saved("mqa_tied")
    c = config_for(directory, FSDP_TP, KV_REPLICATED, hf_dir=str(tmp_path / "out"),
                   dtype="float32")
    c.train.steps = 0
    c.log.tensorboard = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config field is overridden
        train(c, str(tmp_path / "w"), verbose=False)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert_same_weights(loaded, model)


def run_py(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)


@pytest.fixture(scope="module")
def trained_run(saved, tmp_path_factory):
    """train.py: 2 steps from an HF checkpoint, exported (float32) at the end, checkpointed."""
    directory, _ = saved("gqa_llama3")
    root = tmp_path_factory.mktemp("run")
    result = run_py("train.py", "--config=configs/llama_fsdp_tp.py",
                    f"--config.model.init_from={directory}",
                    f"--config.export.hf_dir={root / 'at_end'}", "--config.export.dtype=float32",
                    "--config.train.steps=2", "--config.train.seq_len=32",
                    "--config.log.tensorboard=False", "--config.data.source=synthetic",
                    f"--workdir={root / 'w'}")
    assert result.returncode == 0, result.stderr[-2000:]
    # No config field was overridden (ndjax's warnings are "train.py: warning: ...").
    assert "train.py: warning:" not in result.stderr and "UserWarning" not in result.stderr
    return root


def test_train_py_exports_at_the_end(saved, trained_run):
    loaded, info = AutoModelForCausalLM.from_pretrained(trained_run / "at_end",
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    # Trained: the weights moved away from the source's.
    source = saved("gqa_llama3")[1]
    assert not torch.equal(loaded.lm_head.weight, source.lm_head.weight)


def test_export_cli_writes_what_training_exported(trained_run):
    out = trained_run / "from_checkpoint"
    result = run_py("-m", "ndjax", "export", f"--workdir={trained_run / 'w'}", f"--out={out}",
                    "--dtype=float32")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exported checkpoint step 2" in result.stdout
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (trained_run / "at_end" / name).read_bytes(), name


def test_export_cli_bad_input(trained_run, tmp_path):
    workdir = str(trained_run / "w")
    with pytest.raises(ConfigError, match=r"--step=7: no complete checkpoint of that step in "
                                          r".*there are \[2\]"):
        export_checkpoint(workdir, str(tmp_path / "a"), step=7)
    with pytest.raises(ConfigError, match=r"--workdir=.* has no config.json"):
        export_checkpoint(str(tmp_path), str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"export.hf_dir=.* exists and is not empty"):
        export_checkpoint(workdir, str(trained_run / "at_end"))
    assert os.listdir(tmp_path) == []


# ----- the run's tokenizer ---------------------------------------------------------------


def exported_run(tmp_path, tokenizer="byte", **data):
    """One step of a tiny model from scratch on text, on one device, exported afterwards
    with ndjax export; returns the export directory."""
    write_text(tmp_path / "txt", texts(24))
    c = data_config("text", str(tmp_path / "txt" / "*.txt"), tokenizer=tokenizer, **data)
    c.model.tie_embeddings = False
    c.train.steps = 1
    c.log.tensorboard = False
    one = jax.devices()[:1]
    train(c, str(tmp_path / "w"), devices=one, verbose=False)
    out = tmp_path / "out"
    export_checkpoint(str(tmp_path / "w"), str(out), dtype="float32", devices=one)
    return out


def always_says(model, token):
    """Makes a LlamaForCausalLM's greedy choice ``token`` at every step: the blocks add
    nothing to the residual stream, every token embeds the same, only ``token``'s logit
    row is non-zero (and the final norm's scale, ~1, keeps that logit positive)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token] = 1.0
        model.model.norm.weight.abs_()
    return model


def test_byte_tokenizer_export_stops_at_its_eos(tmp_path):
    """The byte tokenizer ends documents with 256: config.json says so (not LlamaConfig's
    defaults 1 and 2), and transformers' greedy generate stops there."""
    out = exported_run(tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == 256
    assert (config.get("bos_token_id"), config.get("pad_token_id")) == (257, 258)
    model = always_says(AutoModelForCausalLM.from_pretrained(out).eval(), 256)
    assert model.generation_config.eos_token_id == 256
    prompt = torch.tensor([list(b"def f(")])
    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert tokens[0, 6:].tolist() == [256]  # stopped at EOS, not after 8 tokens
    model.generation_config.eos_token_id = 2  # LlamaConfig's default, which exports wrote
    assert model.generate(prompt, max_new_tokens=8, do_sample=False)[0, 6:].tolist() == [256] * 8
    # No tokenizer files: transformers has no tokenizer for these byte ids.
    assert not [n for n in os.listdir(out) if n.startswith(("tokenizer", "special_tokens"))]


@pytest.mark.parametrize("kind", ["saved_by_transformers", "tokenizer_json_only"])
def test_tokenizer_json_export_carries_its_tokenizer(tmp_path, kind):
    """A run on a tokenizer.json: its files (tokenizer_config.json, chat template) go into
    the export, AutoTokenizer loads them and agrees with the run on every special id and on
    the tokens; config.json's ids are the run's. Without a tokenizer_config.json (a bare
    tokenizer.json), the export writes one naming the run's end token."""
    folder = tmp_path / "tok"
    if kind == "saved_by_transformers":  # Qwen-like: EOS <|im_end|> from tokenizer_config
        path = write_hf_tokenizer(folder, **{k: v for k, v in QWEN.items() if k != "special"})
    else:  # EOS <|endoftext|> by its usual name, pad <pad>
        folder.mkdir()
        path = write_tokenizer(folder / "tokenizer.json", texts(24))
    tok = load_tokenizer(str(path))
    out = exported_run(tmp_path, str(path))
    assert (out / "tokenizer.json").read_bytes() == path.read_bytes()
    ref = AutoTokenizer.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == ref.eos_token_id == tok.eos_id
    assert config["pad_token_id"] == ref.pad_token_id == tok.pad_id
    assert config["bos_token_id"] is None and ref.bos_token_id is None  # none in either
    assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == tok.eos_id
    text = texts(1)[0]
    assert ref(text, add_special_tokens=False).input_ids == tok.encode(text)
    if kind == "saved_by_transformers":
        assert ref.decode([tok.eos_id]) == "<|im_end|>"
        chat = [{"role": "user", "content": "alpha beta"}]
        original = AutoTokenizer.from_pretrained(folder)
        assert ref.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(
            chat, tokenize=False)
        assert sorted(os.listdir(out)) == sorted(
            ["config.json", "model.safetensors", *os.listdir(folder)])


@pytest.mark.parametrize("run", ["byte", "source_tokenizer"])
def test_export_from_a_checkpoint_takes_the_run_token_ids(tmp_path, run):
    """From model.init_from: config.json and the copied generation_config.json get the
    run's ids. A byte run drops the source's tokenizer files (its ids are bytes); a run on
    the source's own tokenizer.json keeps them, with the EOS of its tokenizer_config.json."""
    source = tmp_path / "source"
    make_hf(source, **CASES["odd_sizes"])  # vocab 264 holds the byte tokenizer's 259 ids
    path = write_hf_tokenizer(source, **{k: v for k, v in QWEN.items() if k != "special"})
    tok = load_tokenizer("byte" if run == "byte" else str(path))
    exp = Experiment.from_config(config_for(source), jax.devices()[:1])
    out = tmp_path / "out"
    hf.export(load(exp), exp.model_cfg, str(out), "float32", source=exp.checkpoint,
              tokenizer=tok)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    # The source's bos 1 stays where the run's tokenizer has none (Qwen's).
    want = (tok.eos_id, 1 if tok.bos_id is None else tok.bos_id, tok.pad_id)
    for ids in (config, generation):
        assert (ids["eos_token_id"], ids["bos_token_id"], ids["pad_token_id"]) == want
    names = {n for n in os.listdir(out) if n.startswith(("tokenizer", "chat_template"))}
    assert names == (set() if run == "byte" else
                     {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})


@pytest.mark.parametrize("current, eos, want", [
    (2, 7, 7), ([5, 7], 7, [5, 7]), ([5, 6], 7, 7), (None, 7, 7), (7, 7, 7)])
def test_eos_of_the_source_is_kept_when_it_holds_the_run_eos(current, eos, want):
    """Llama 3 Instruct's generation_config.json stops at [128001, 128008, 128009]: a run
    whose EOS is one of them keeps the list; any other source EOS gives way to the run's."""
    tok = load_tokenizer("byte")
    tok = type("Tok", (), dict(eos_id=eos, bos_id=tok.bos_id, pad_id=tok.pad_id))()
    assert hf.with_token_ids({"eos_token_id": current}, tok)["eos_token_id"] == want


# ----- bad input ----------------------------------------------------------------------


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def drop(directory, name):
    os.remove(directory / name)


BAD = {
    "missing config.json": (lambda d: drop(d, "config.json"), {},
                            r"init_from='.*' has no config.json"),
    "missing weights": (lambda d: drop(d, "model.safetensors"), {},
                        r"has no model.safetensors or model.safetensors.index.json"),
    "missing shard": (lambda d: drop(d, next(d.glob("model-00002-of-*")).name),
                      dict(max_shard_size="80KB"),
                      r"index.json names \['model-00002-of-0000\d.safetensors'\] files that "
                      r"are not there"),
    "truncated weights": (lambda d: os.truncate(d / "model.safetensors", 1000), {},
                          r"model.safetensors is not a readable safetensors file \(.*\)\. "
                          r"Re-save it"),
    "shape vs config.json": (lambda d: edit_config(d, intermediate_size=144), {},
                             r"mlp.gate_proj.weight has shape \(128, 64\), but config.json "
                             r"implies \(144, 64\) \(hidden_size=64, intermediate_size=144"),
    "layers vs config.json": (lambda d: edit_config(d, num_hidden_layers=1), {},
                              r"do not match config.json .*num_hidden_layers=1.*unexpected "
                              r"\['model.layers.1."),
    "unsupported family": (lambda d: edit_config(d, model_type="phi3",
                                                 architectures=["Phi3ForCausalLM"]), {},
                           r"model_type='phi3' \(architectures "
                           r"\['Phi3ForCausalLM'\]\), which ndjax does not implement; "
                           r"it reads the model_types"),
    "unsupported rope": (lambda d: edit_config(d, rope_parameters=dict(
        rope_type="dynamic", factor=4.0, rope_theta=1e4)), {},
        r"rope type 'dynamic' is not supported"),
    "mesh cannot divide": (lambda d: None, dict(intermediate_size=129),
                           r"model.ffn_dim=129 .* cannot be split 2 ways over mesh axes "
                           r"tensor\(2\).*come from model.init_from="),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_a_config_error(tmp_path, case):
    spoil, overrides, match = BAD[case]
    source = tmp_path / "source"
    make_hf(source, **overrides)
    spoil(source)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        Experiment.from_config(config_for(source, FSDP_TP, hf_dir=str(out)))
    assert sorted(os.listdir(tmp_path)) == ["source"]  # nothing written


def test_hub_id_says_download_first():
    with pytest.raises(ConfigError, match=r"model.init_from='meta-llama/Llama-3.2-1B' is not a "
                                          r"local directory.*does not download.*hf download"):
        Experiment.from_config(config_for("meta-llama/Llama-3.2-1B", FSDP_TP))


@pytest.mark.parametrize("export, match", [
    (dict(dtype="int8"), r"export.dtype='int8': choose one of"),
    (dict(hf_dir="EXISTING"), r"export.hf_dir='.*' exists and is not empty"),
    (dict(max_shard_size="5XB"), r"export.max_shard_size='5XB': write a positive number of "
                                 r"bytes or a size like '5GB'"),
    (dict(max_shard_size=0), r"export.max_shard_size=0: write a positive number"),
])
def test_bad_export_fields_fail_before_training(tmp_path, export, match):
    (tmp_path / "keep.txt").write_text("x")
    if export.get("hf_dir") == "EXISTING":
        export["hf_dir"] = str(tmp_path)
    c = tiny_config(mesh=FSDP_TP)
    c.export.update(export)
    with pytest.raises(ConfigError, match=match):
        Experiment.from_config(c)
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_failed_export_leaves_nothing(saved, tmp_path, monkeypatch):
    directory, _ = saved("odd_sizes")
    exp = Experiment.from_config(config_for(directory, FSDP_TP))
    params = load(exp)
    calls = []

    def failing_host(x):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return np.asarray(jax.device_get(x))

    monkeypatch.setattr(hf, "_host", failing_host)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        hf.export(params, exp.model_cfg, str(out), "float32")
    assert len(calls) == 5 and os.listdir(tmp_path) == []
