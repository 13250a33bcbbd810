"""Every model family against transformers, and on every layout against one device.

One parametrised suite: a family is a registry entry plus a tiny transformers config
here. Tolerances as tests/test_hf.py (logits max abs difference <= 1e-4 in float32,
on logits with a spread of ~1; weights passing through import -> export come back
bit-identical) and tests/test_layouts.py (helpers.assert_same_training).
"""

import importlib.util
import json
import warnings

import jax
import numpy as np
import pytest
import torch
from conftest import tiny_config
from data_files import WORDS
from helpers import (
    GRAD_RTOL,
    _reference,
    assert_same_training,
    host_batches,
    run_steps,
)
from test_generate import N_NEW, run_generate
from test_hf import (
    BASE,
    FSDP_TP,
    B,
    S,
    config_for,
    expected_params,
    hf_logits,
    load,
    ndjax_logits,
)
from test_tokenizer_files import QWEN, write_hf_tokenizer
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    TokenizersBackend,
)

from ndjax.experiment import Experiment
from ndjax.models import hf_config, registry
from ndjax.parallel import rules as rules_lib
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.step.objectives import CrossEntropy
from ndjax.step.train_step import router_loss
from ndjax.training import summary

WINDOW = 8  # < S, and < each packed document below
GEMMA_TYPES = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
# family -> (config class, model class, config fields): random tiny models that use
# every option of the family (Gemma: 5 layers alternating, so one scanned period of
# 2 and a layer after it; a query scalar that is not head_dim).
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, num_hidden_layers=5, layer_types=GEMMA_TYPES, sliding_window=WINDOW,
        query_pre_attn_scalar=12, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Mixtral renormalises its top-2 weights; this Qwen3-MoE does not (norm_topk_prob
    # False, transformers' default; the released models set it).
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False)),
    # Qwen 2 MoE: a shared expert of its own width beside the routed ones, and q/k/v biases.
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False)),
    # GPT-OSS: sinks, biases on q/k/v/o, the router and the experts, a window in every
    # other layer, YaRN past a short original length, and a SwiGLU limit the experts'
    # activations reach (the released 7.0 would rarely clamp at this scale).
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        swiglu_limit=1.0, attn_implementation="eager", rope_parameters=dict(
            rope_type="yarn", rope_theta=150_000.0, factor=4.0, beta_fast=32.0,
            beta_slow=1.0, truncate=False, original_max_position_embeddings=16))),
    # DeepSeek V3: latent attention with both latents (values narrower than the q/k
    # heads), YaRN with its softmax scale, a dense first layer then two MoE ones, grouped
    # sigmoid routing with the load-balancing bias, a shared expert.
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=8, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        attn_implementation="eager", rope_parameters=dict(
            rope_type="yarn", rope_theta=10_000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=16))),
}


def make_family_hf(directory, family, seed=0, dtype=torch.float32, max_shard_size=None,
                   **overrides):
    """A random model of ``family`` saved to ``directory`` (in ``dtype``, in files of
    at most ``max_shard_size``; ``overrides``: config fields); returns it (float32)."""
    config_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **fields, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at 1 (Gemma: 0) and biases at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family == "gemma3" else p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("sinks"):  # GPT-OSS: large enough to take a row's weight
                p.normal_(0.0, 2.0)
        for name, b in model.named_buffers():  # DeepSeek V3's: large enough to move choices
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.to(dtype).save_pretrained(directory, **kwargs)
    return model.float()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            cache[family] = (directory, make_family_hf(directory, family))
        return cache[family]
    return get


def tokens(vocab, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, (B, S)).astype(np.int32)


@pytest.mark.parametrize("mesh", ["one_device", "fsdp_tp"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(saved, family, mesh):
    directory, model = saved(family)
    devices = jax.devices()[:1] if mesh == "one_device" else None
    exp = Experiment.from_config(config_for(directory, None if devices else FSDP_TP),
                                 devices)
    assert exp.model_cfg.family == family
    toks = tokens(model.config.vocab_size)
    ref = hf_logits(model, toks)
    assert ref.std() > 0.5
    np.testing.assert_allclose(ndjax_logits(exp, load(exp), toks), ref, rtol=0, atol=1e-4)


# GPT-OSS's sinks and DeepSeek V3's latent attention in the context-parallel kernels, and
# their experts split over mesh.expert beside tensor parallelism.
OPEN_MODEL_MESHES = {
    "fsdp_expert_tensor": (dict(fsdp=2, expert=2, tensor=2), {}),
    "fsdp_context_ring": (dict(fsdp=4, context=2), dict(cp_impl="ring", cp_layout="contiguous")),
    "fsdp_context_all_to_all": (dict(fsdp=4, context=2), dict(cp_impl="all_to_all")),
}


@pytest.mark.parametrize("mesh", sorted(OPEN_MODEL_MESHES))
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_the_open_models_logits_match_transformers_on_their_layouts(saved, family, mesh):
    directory, model = saved(family)
    axes, fields = OPEN_MODEL_MESHES[mesh]
    config = config_for(directory, axes)
    config.model.update(fields)
    exp = Experiment.from_config(config)
    if "context" in axes:
        assert exp.attention.cp == fields["cp_impl"], exp.attention
    toks = tokens(model.config.vocab_size)
    np.testing.assert_allclose(ndjax_logits(exp, load(exp), toks), hf_logits(model, toks),
                               rtol=0, atol=1e-4)


MOE_FAMILIES = sorted(f for f in FAMILIES if registry.get(f).moe_names is not None)
# Those whose transformers model has Switch's load-balancing loss (DeepSeek V3's has none:
# it balances with its routing bias, tests/test_deepseek_v3.py).
SWITCH_LOSS = [f for f in MOE_FAMILIES if f != "deepseek_v3"]


@pytest.mark.parametrize("mesh, padded", [("one_device", False), ("fsdp_tp", False),
                                          ("fsdp_tp", True)])
@pytest.mark.parametrize("family", SWITCH_LOSS)
def test_load_balancing_loss_matches_transformers(saved, family, mesh, padded):
    """The router's load-balancing loss over all layers equals transformers' aux_loss
    (output_router_logits) on the same weights and tokens: rows without padding and no
    attention mask, or rows that end in padding (segment id 0), which it leaves out as
    transformers' attention mask does."""
    directory, model = saved(family)
    devices = jax.devices()[:1] if mesh == "one_device" else None
    exp = Experiment.from_config(config_for(directory, None if devices else FSDP_TP), devices)
    toks = tokens(model.config.vocab_size)
    real = np.ones_like(toks)
    if padded:
        real[:, S - 7:] = 0
        real[1, S - 12:] = 0
    with torch.no_grad():
        mask = dict(attention_mask=torch.tensor(real)) if padded else {}
        want = float(model(torch.tensor(toks, dtype=torch.long), output_router_logits=True,
                           **mask).aux_loss)
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), toks.shape)
    with rules_lib.use(exp.rules):
        aux = jax.jit(exp.features)(load(exp), toks, positions, real)[2]
    # Balanced routing gives experts_per_token (2): the random router is not balanced.
    assert abs(want - 2.0) > 1e-3
    np.testing.assert_allclose(float(aux["aux_loss"]), want, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_rows_equal_each_document_alone(saved, family):
    """Two documents in one row (segment ids, positions restarting), each longer than
    the window: each one's logits equal transformers' on that document alone."""
    directory, model = saved(family)
    exp = Experiment.from_config(config_for(directory), jax.devices()[:1])
    toks = tokens(model.config.vocab_size, seed=2)
    cut = 19
    positions = np.concatenate([np.arange(cut), np.arange(S - cut)]).astype(np.int32)
    segments = np.concatenate([np.ones(cut), np.full(S - cut, 2)]).astype(np.int32)
    with rules_lib.use(exp.rules):
        out = np.asarray(jax.jit(exp.apply)(load(exp), toks, np.broadcast_to(positions, toks.shape),
                                            np.broadcast_to(segments, toks.shape)))
    np.testing.assert_allclose(out[:, :cut], hf_logits(model, toks[:, :cut]), rtol=0, atol=1e-4)
    np.testing.assert_allclose(out[:, cut:], hf_logits(model, toks[:, cut:]), rtol=0, atol=1e-4)


def hf_loss(model, toks):
    """transformers' training loss on ``toks`` with themselves as labels (it shifts them):
    the mean next-token cross-entropy, plus router_aux_loss_coef x the load-balancing
    loss where the config's output_router_logits is true."""
    ids = torch.tensor(toks, dtype=torch.long)
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def ndjax_loss(exp, toks):
    """What ndjax's step differentiates on the same tokens: the cross-entropy of every
    position but the last (which has no next token) plus ``train_step.router_loss``;
    the router sees every token, as transformers' does without an attention mask."""
    targets = np.concatenate([toks[:, 1:], np.zeros_like(toks[:, :1])], axis=1)
    mask = np.ones(toks.shape, np.float32)
    mask[:, -1] = 0
    batch = dict(inputs=toks, targets=targets, loss_mask=mask,
                 positions=np.broadcast_to(np.arange(S, dtype=np.int32), toks.shape),
                 segment_ids=np.ones_like(toks))
    with rules_lib.use(exp.rules):
        total, n, aux = jax.jit(lambda p, b: CrossEntropy().loss_sum(exp.features, p, b, S)
                                 )(load(exp), batch)
    return float(total / n + router_loss(exp.step_options, aux))


def loss_line(exp, workdir):
    lines = [x for x in summary.startup(exp, str(workdir), None) if x.startswith("loss: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("output_router_logits", [False, True])
@pytest.mark.parametrize("family", SWITCH_LOSS)
def test_the_aux_loss_is_in_the_loss_as_config_json_says(saved, family, output_router_logits,
                                                          tmp_path):
    """As transformers trains a checkpoint, its load-balancing loss (times
    router_aux_loss_coef) is in the loss only where config.json's output_router_logits
    is true (false in the released Mixtral and Qwen MoE files): ndjax's objective equals
    transformers' loss on the same weights and tokens either way, the start-up line
    names the terms, and an export writes the flag back (off: the source's weight kept).
    model.router_aux_loss_coef, set, wins over config.json, without the warning an
    overridden model field gets; on a dense checkpoint it is refused."""
    directory, _ = saved(family)
    source = json.loads((directory / "config.json").read_text())
    source.update(output_router_logits=output_router_logits, router_aux_loss_coef=0.1)
    (tmp_path / "config.json").write_text(json.dumps(source))
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = config_for(tmp_path)
    exp = Experiment.from_config(config, jax.devices()[:1])
    toks = tokens(model.config.vocab_size)
    # The load-balancing loss (~2) x 0.1 is ~4% of the loss (~5): far above rtol.
    np.testing.assert_allclose(ndjax_loss(exp, toks), hf_loss(model, toks), rtol=1e-5)
    line = loss_line(exp, tmp_path)
    written = hf.hf_config(exp.model_cfg, "float32", source)
    assert written["output_router_logits"] is output_router_logits
    assert written["router_aux_loss_coef"] == 0.1
    if output_router_logits:
        assert exp.step_options.aux_loss_coef == 0.1
        assert line.startswith("loss: cross-entropy + 0.1 x load-balancing loss (aux_loss); "
                               "logged, not trained on: router_z_loss"), line
        return
    assert exp.step_options.aux_loss_coef == 0.0
    assert line.startswith("loss: cross-entropy; logged, not trained on: aux_loss"), line
    assert "output_router_logits false" in line and "model.router_aux_loss_coef" in line
    config.model.router_aux_loss_coef = 0.25
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exp = Experiment.from_config(config, jax.devices()[:1])
    assert exp.model_cfg.router_aux_loss_coef == exp.step_options.aux_loss_coef == 0.25
    assert loss_line(exp, tmp_path).startswith("loss: cross-entropy + 0.25 x load-balancing")
    written = hf.hf_config(exp.model_cfg, "float32", source)
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, 0.25)
    dense = config_for(saved("llama")[0])
    dense.model.router_aux_loss_coef = 0.25
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=0.25: model.family="
                                          "'llama' has no experts"):
        Experiment.from_config(dense, jax.devices()[:1])


# The experts split over fsdp, each expert's width over tensor, the rows of the
# checkpoint's matrices (embed) whole: each device reads its experts' tensors only.
EXPERTS_SPLIT = tuple((name, {"experts": "fsdp", "embed": None}.get(name, axes))
                      for name, axes in rules_lib.PRESETS["default"])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_shards_hold_transformers_experts(tmp_path, family):
    """A bfloat16 checkpoint in several files, read with the experts split over fsdp and
    their width over tensor: every device's shard of every MoE parameter holds
    transformers' in-memory (fused) experts, router and all, rounded to bfloat16 as
    saved. The fused tensors are read here independently of the checkpoint's names:
    gate_up_proj is (experts, gate rows then up rows, dim), down_proj (experts, dim,
    width)."""
    model = make_family_hf(tmp_path, family, dtype=torch.bfloat16, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    exp = Experiment.from_config(config_for(tmp_path, FSDP_TP, rules=EXPERTS_SPLIT))
    params = load(exp)
    f = getattr(model.config, "moe_intermediate_size", model.config.intermediate_size)
    layers = [x for x in model.model.layers if hasattr(x.mlp, "experts")]  # (DeepSeek's first)
    bf16 = lambda t: t.detach().to(torch.bfloat16).float().numpy()  # noqa: E731
    want = {
        "router": np.stack([bf16(x.mlp.gate.weight).T for x in layers]),
        "w_gate": np.stack([bf16(x.mlp.experts.gate_up_proj[:, :f]).transpose(0, 2, 1)
                            for x in layers]),
        "w_up": np.stack([bf16(x.mlp.experts.gate_up_proj[:, f:]).transpose(0, 2, 1)
                          for x in layers]),
        "w_down": np.stack([bf16(x.mlp.experts.down_proj).transpose(0, 2, 1)
                            for x in layers]),
    } if family != "gpt_oss" else {
        # (experts, dim, gate and up interleaved), (experts, width, dim), and biases.
        "router": np.stack([bf16(x.mlp.router.weight).T for x in layers]),
        "router_bias": np.stack([bf16(x.mlp.router.bias) for x in layers]),
        "w_gate": np.stack([bf16(x.mlp.experts.gate_up_proj[..., ::2]) for x in layers]),
        "w_up": np.stack([bf16(x.mlp.experts.gate_up_proj[..., 1::2]) for x in layers]),
        "b_gate": np.stack([bf16(x.mlp.experts.gate_up_proj_bias[..., ::2]) for x in layers]),
        "b_up": np.stack([bf16(x.mlp.experts.gate_up_proj_bias[..., 1::2]) for x in layers]),
        "w_down": np.stack([bf16(x.mlp.experts.down_proj) for x in layers]),
        "b_down": np.stack([bf16(x.mlp.experts.down_proj_bias) for x in layers]),
    }
    for name, value in want.items():
        got = params["layers"]["mlp"][name]
        if not name.startswith("router"):
            assert got.sharding.spec[1] == "fsdp"  # the experts are split
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data, np.float32), value[shard.index],
                                          err_msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_in_transformers_with_identical_weights(saved, family, tmp_path):
    directory, model = saved(family)
    exp = Experiment.from_config(config_for(directory), jax.devices()[:1])
    out = tmp_path / "export"
    hf.export(load(exp), exp.model_cfg, str(out), "float32", source=exp.checkpoint)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model.config.model_type
    back = AutoModelForCausalLM.from_pretrained(  # the same attention code as the source's
        out, dtype=torch.float32, attn_implementation=model.config._attn_implementation)
    assert type(back) is type(model)
    want = model.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    toks = tokens(model.config.vocab_size)
    np.testing.assert_array_equal(hf_logits(back, toks), hf_logits(model, toks))


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_bf16_shards_from_several_files(tmp_path, family):
    """Each device's shard (fsdp x tensor), read from a bfloat16 checkpoint split over
    files, holds exactly the checkpoint's values: the biases (flattened in the HF file)
    and Gemma's four norms and q/k norms too."""
    model = make_family_hf(tmp_path, family, dtype=torch.bfloat16, max_shard_size="40KB")
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]) > 3
    exp = Experiment.from_config(config_for(tmp_path, FSDP_TP))
    expected = expected_params(model, exp.param_shapes, exp.model_cfg)
    params = load(exp)
    for (path, got), want, sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                           jax.tree.leaves(expected),
                                           jax.tree.leaves(exp.state_sharding.params)):
        assert got.sharding == sharding and got.dtype == np.float32, path
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))


# Required keys (no other) of a small model: a head count that is none of transformers'
# default kv head counts, and 7 layers, so that Gemma's default pattern has a global layer.
SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=7, num_attention_heads=16,
             intermediate_size=128)


@pytest.mark.parametrize("required", [None, SMALL], ids=["no_arguments", "small"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_absent_keys_read_as_transformers_defaults(family, required):
    """A config.json with only the required keys reads as the full config.json that
    transformers' config class writes for it (its defaults for every other key)."""
    full = FAMILIES[family][0](**(required or {})).to_dict()
    bare = {k: full[k] for k in ("model_type", *hf_config.REQUIRED)}
    fam = registry.get(family)
    assert fam.read_config_json(bare, "bare") == fam.read_config_json(full, "full")


def test_gemma_config_json_of_old_format_reads_its_pattern(saved, tmp_path):
    """A Gemma 3 config.json as transformers 4.x wrote it (sliding_window_pattern, no
    layer_types; rope_theta, rope_local_base_freq and rope_scaling at the top level)
    has transformers' layer types, and its logits."""
    directory, _ = saved("gemma3")
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    full = rope["full_attention"]
    config.update(sliding_window_pattern=2, rope_theta=full["rope_theta"],
                  rope_scaling={k: full[k] for k in ("rope_type", "factor")},
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.config.layer_types == GEMMA_TYPES  # what transformers derives
    exp = Experiment.from_config(config_for(tmp_path), jax.devices()[:1])
    assert list(exp.model_cfg.types) == GEMMA_TYPES
    toks = tokens(model.config.vocab_size)
    np.testing.assert_allclose(ndjax_logits(exp, load(exp), toks), hf_logits(model, toks),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("family, key, value, says", [
    ("gemma3", "sliding_window_pattern", 0, "sliding_window_pattern=0 must be an int >= 1"),
    ("gemma3", "query_pre_attn_scalar", None, "query_pre_attn_scalar=None must be a number > 0"),
    ("gemma3", "rope_local_base_freq", "1e4", "rope_local_base_freq='1e4' must be a number > 0"),
    ("mixtral", "output_router_logits", "yes", "output_router_logits='yes' must be true or "
                                               "false"),
    ("qwen3_moe", "router_aux_loss_coef", -0.1, "router_aux_loss_coef=-0.1 must be a number "
                                                ">= 0"),
])
def test_a_bad_config_json_value_is_refused_in_one_line(family, key, value, says):
    with pytest.raises(ConfigError) as e:
        registry.get(family).read_config_json({**SMALL, key: value}, "d")
    assert str(e.value).startswith(f"model.init_from='d': config.json {says}")
    assert "\n" not in str(e.value)


# Layouts against one device (3 AdamW steps, f32), on the tiny config of each family
# with its options switched on.
FAMILY_MODELS = {
    "mistral": dict(family="mistral", sliding_window=WINDOW),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_dim=16),
    "gemma3": dict(family="gemma3", n_layers=3, head_dim=16, sliding_window=WINDOW,
                   sliding_window_pattern=2, query_pre_attn_scalar=12.0),
    # The load-balancing loss in the loss, weighted so that it moves the router. One MoE
    # family: Mixtral's block is the same code but for its names and renormalising.
    "qwen3_moe": dict(family="qwen3_moe", head_dim=16, n_experts=4, experts_per_token=2,
                      moe_ffn_dim=32, router_aux_loss_coef=0.1),
    # Sinks in ring attention's log-sum-exp, biases on the attention and the experts.
    "gpt_oss": dict(family="gpt_oss", head_dim=16, n_experts=4, experts_per_token=2,
                    sliding_window=WINDOW, sliding_window_pattern=2, router_aux_loss_coef=0.1),
    # Latent attention (as many kv heads as heads: its keys are per head) over ring, a
    # dense first layer, grouped routing, and the load-balancing bias moving every step.
    "deepseek_v3": dict(family="deepseek_v3", n_kv_heads=8, head_dim=16, rope_head_dim=8,
                        v_head_dim=12, q_lora_rank=24, kv_lora_rank=16, n_experts=4,
                        experts_per_token=2, moe_ffn_dim=32, shared_expert_dim=32,
                        first_k_dense=1, n_group=2, topk_group=1, score_bias_rate=0.01),
}


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_layout_matches_single_device(family):
    """fsdp x context x tensor in one layout: parameters over fsdp x context, ring
    attention over context (with the family's window), and tensor wider than the one
    kv head (replicated on both shards whose query heads use it). tests/test_layouts.py
    runs each of those on its own for Llama; here every family meets them all. The
    mixtures of experts take expert=2 for fsdp (the experts split over it, the other
    weights stored over it as over fsdp): DeepSeek V3's grouped routing, its bias
    moving, and GPT-OSS's biased experts meet the experts' exchange beside context."""
    latent = family == "deepseek_v3"  # keys per head: no kv heads to replicate
    model = {**FAMILY_MODELS[family], **({} if latent else {"n_kv_heads": 1})}
    moe = bool(model.get("n_experts"))
    mesh = dict(expert=2, context=2, tensor=2) if moe else dict(fsdp=2, context=2, tensor=2)
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=model))
    assert exp.attention.name == "ring"
    assert latent or exp.rules.kv_repeat(1) == 2
    if moe:
        spec = exp.state_sharding.params["layers"]["mlp"]["w_gate"].spec
        assert "expert" in jax.tree.leaves(tuple(spec)), spec
    assert_same_training(exp, model)


# Qwen 2 MoE: the shared expert (a dense MLP beside the routed ones) and its gate.
SHARED_EXPERT = dict(FAMILY_MODELS["qwen3_moe"], family="qwen2_moe", head_dim=None,
                     shared_expert_dim=48)


@pytest.mark.parametrize("mesh, capacity, model", [
    (dict(fsdp=1, expert=4, tensor=2), None, FAMILY_MODELS["qwen3_moe"]),
    (dict(replica=2, fsdp=2, expert=2), None, FAMILY_MODELS["qwen3_moe"]),
    (dict(fsdp=2, expert=2, tensor=2), None, SHARED_EXPERT),
    (dict(fsdp=2, expert=2, tensor=2), 1.0, FAMILY_MODELS["gpt_oss"])],
    ids=["expert_tensor", "replica_fsdp_expert", "shared_expert_fsdp_expert_tensor",
         "gpt_oss_fsdp_expert_tensor_capacity"])
def test_expert_parallel_layouts_match_single_device(mesh, capacity, model):
    """The experts split over mesh.expert (each device holds its share; the (token,
    expert) pairs travel to them and back in ragged all-to-alls, emulated on CPU from
    an all-gather), beside FSDP, tensor parallelism and replicas; a shared expert, its
    width over tensor, beside experts split over expert and fsdp; and GPT-OSS's biased
    experts in capacity mode (refused with context), which drops the same pairs on every
    layout (each row's first, per expert). DeepSeek V3's grouped routing (each of its 2
    groups on one expert shard) meets the exchange in test_layout_matches_single_device;
    fsdp x expert=4 is test_moe's (every token on one expert, dropless and in capacity
    mode)."""
    model = dict(model, capacity_factor=capacity)
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=model))
    spec = exp.state_sharding.params["layers"]["mlp"]["w_gate"].spec
    assert "expert" in jax.tree.leaves(tuple(spec)), spec
    if capacity is not None:  # pairs are dropped, or this would only test dropless
        batch = exp.device_batch(host_batches(exp.config, 1)[0])
        with rules_lib.use(exp.rules):
            aux = jax.jit(exp.features)(exp.init_state().params, batch["inputs"],
                                        batch["positions"], batch["segment_ids"])[2]
        assert float(aux["expert_dropped"]) > 0.01, aux
    assert_same_training(exp, model)


def test_an_unsupported_model_type_names_the_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(ConfigError) as e:
        hf.open_checkpoint(str(tmp_path))
    message = str(e.value)
    assert "model_type='phi3'" in message and "\n" not in message
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral",
                       "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "kimi_k2"):
        assert f"'{model_type}'" in message


@pytest.mark.parametrize("family, field, value, says", [
    ("llama", "qk_norm", True, "model.qk_norm=True: model.family='llama' has no q/k norms"),
    ("qwen2", "sliding_window", 64, "model.sliding_window=64: model.family='qwen2' has no "
                                    "sliding window"),
    ("qwen3", "qk_norm", False, "model.qk_norm=False: model.family='qwen3' has no q/k norms to "
                                "change"),
])
def test_an_option_the_family_lacks_is_refused(family, field, value, says):
    config = tiny_config(model={"family": family, field: value})
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(config, jax.devices()[:1])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_every_family_has_a_tiny_preset_and_real_sizes():
    for name, family in registry.families().items():
        assert "tiny" in family.presets and len(family.presets) > 1, name


# Each family's own special tokens, in a word-level tokenizer (test_tokenizer_files):
# Llama 3's, Mistral's and Gemma's put a BOS before every prompt, Qwen's none.
FAMILY_TOKENS = {
    "llama": dict(special=("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
                  bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"),
    "mistral": dict(special=("<unk>", "<s>", "</s>"), bos_token="<s>", eos_token="</s>"),
    "qwen2": dict(QWEN),
    "qwen3": dict(QWEN),
    "qwen3_moe": dict(QWEN),
    "qwen2_moe": dict(QWEN),
    "mixtral": dict(special=("<unk>", "<s>", "</s>"), bos_token="<s>", eos_token="</s>"),
    "gemma3": dict(special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                   bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
    "deepseek_v3": dict(special=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
                        bos_token="<｜begin▁of▁sentence｜>",
                        eos_token="<｜end▁of▁sentence｜>"),
    # gpt-oss's harmony tokens: no BOS before a prompt.
    "gpt_oss": dict(special=("<|startoftext|>", "<|endoftext|>", "<|return|>"),
                    eos_token="<|return|>", pad_token="<|endoftext|>"),
}
# 2, 9 and 19 words (and a BOS): the longer two run past WINDOW (Mistral's and Gemma's
# local layers).
GENERATE_PROMPTS = ("alpha beta", "doc 7 : gamma delta pi rho sigma tau",
                    " ".join(WORDS[3:22]))


def greedy(model, ids, eos, n=N_NEW):
    """transformers' greedy new tokens for ``ids`` alone, the EOS included when it stops."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                             eos_token_id=list(eos), pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def stop_words(refs):
    """Two tokens that make greedy generation stop where transformers' does: the first
    one of prompt 1 (an empty completion) and one that the last prompt first meets
    after a few tokens."""
    first, last = refs[0][0], refs[-1]
    mid = next((t for j, t in enumerate(last[2:-1], 2) if t not in (*last[:j], first)), None)
    assert mid is not None, f"the last prompt's completion {last} repeats itself"
    return first, mid


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cli_generates_as_transformers(family, tmp_path):
    """``ndjax generate --hf_dir`` on a random model with its family's own
    (word-level) tokenizer: each prompt's completion and token counts are those of
    transformers' greedy generate on that prompt alone (ndjax: one left-padded batch,
    a KV cache, windows over the cache), stopping at generation_config.json's EOS ids.

    The reference tokenizer is the directory's tokenizer.json as written, which ndjax
    reads (and trains with). Not AutoTokenizer: for model_type qwen2 (of ndjax's
    families, only) transformers 5 ignores tokenizer_config.json's class and rebuilds
    the tokenizer as a byte-level BPE (Qwen2Tokenizer) from tokenizer.json's vocabulary;
    for Qwen's own BPE files that is the same tokenizer, for a word-level one it drops
    every word of a prompt (a different prompt, so a different completion)."""
    tokens = dict(FAMILY_TOKENS[family])
    path = write_hf_tokenizer(tmp_path, chat_template=None, add_bos="bos_token" in tokens,
                              **tokens)
    tok = TokenizersBackend.from_pretrained(tmp_path)
    ids = {name: tok.convert_tokens_to_ids(tokens[name + "_token"])
           for name in ("bos", "eos", "pad") if name + "_token" in tokens}
    prompts = [tok(p).input_ids for p in GENERATE_PROMPTS]
    assert [p[0] == ids.get("bos") for p in prompts] == ["bos" in ids] * 3
    # The first random model whose greedy completions meet both stops where the test
    # wants them (Qwen 2 MoE's seed 0 meets the first one as the last prompt's 2nd token).
    for seed in range(3):
        model = make_family_hf(tmp_path, family, seed=seed, vocab_size=len(tok),
                               **{f"{k}_token_id": v for k, v in ids.items()})
        if family == "gemma3":
            # Its embedding, scaled by sqrt(dim), outweighed the layers, and the model
            # repeated the prompt's last token: a weak check of the decode steps.
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(0.5)
                for name, p in model.named_parameters():
                    if ".post_" in name:
                        p.uniform_(1.0, 3.0)
            model.save_pretrained(tmp_path)
        eos = (ids["eos"], *stop_words([greedy(model, p, (ids["eos"],)) for p in prompts]))
        refs = [greedy(model, p, eos) for p in prompts]
        if len(refs[0]) == 1 and 2 < len(refs[-1]) < N_NEW:  # both stops are met
            break
    else:
        pytest.fail(f"no seed gave completions that meet both stops: {refs}")
    config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config,
                                                                 "eos_token_id": eos}))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                              for p in GENERATE_PROMPTS))
    result = run_generate(f"--hf_dir={path.parent}", f"--prompts_file={tmp_path / 'p.jsonl'}",
                          f"--max_new_tokens={N_NEW}", "--json",
                          "--config.runtime.cpu_devices=1")
    assert result.returncode == 0, result.stderr[-2000:]
    got = [json.loads(line) for line in result.stdout.splitlines()]
    # Word-level tokens decode one word each (specials as their text): equal texts and
    # counts are equal tokens.
    want = [dict(prompt=text, completion=tok.decode([t for t in r if t not in eos]),
                 prompt_tokens=len(p), completion_tokens=len(r))
            for text, p, r in zip(GENERATE_PROMPTS, prompts, refs)]
    assert got == want


# configs/llama_fsdp_tp.py is the default experiment, which test_train_cli runs.
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"llama"}))
def test_each_family_config_builds(family):
    """configs/<family>_fsdp_tp.py (docs/families.md's command per family) checks and builds."""
    spec = importlib.util.spec_from_file_location(family, f"configs/{family}_fsdp_tp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    exp = Experiment.from_config(module.get_config())
    assert exp.model_cfg.family == family and exp.mesh.shape["tensor"] == 2


@pytest.mark.parametrize("variant", [dict(remat="full"), dict(scan_layers=False)])
def test_local_and_global_layers_train_alike_however_run(variant):
    """Gemma's mixed layers (one scanned period of 2, then a layer after it) give the
    same losses and first-step gradients under full remat (each layer of a period
    recomputed on its own) and unrolled as scanned without remat."""
    model = dict(FAMILY_MODELS["gemma3"], remat="none")
    ref_init, ref_losses, _, ref_grads = _reference(model)
    exp = Experiment.from_config(tiny_config(model={**model, **variant}), jax.devices()[:1])
    grads = []
    losses, _ = run_steps(exp, ref_init, grads=grads)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads[0]),
                               jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, want, rtol=0, atol=GRAD_RTOL * np.abs(want).max(),
                                   err_msg=jax.tree_util.keystr(path))
