"""QLoRA's quantized base (ndjax.models.quant): the NF4 levels are QLoRA's, quantizing and
reading back agree bit for bit with a plain reference and stay within each format's
bound, a QLoRA step is a LoRA step on the read-back base, trains like one device on
fsdp x tensor, imports an HF checkpoint quantized shard by shard, and exports merged."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_config
from helpers import assert_same_training, first_step_grads, run_steps

from ndjax.experiment import Experiment
from ndjax.models import lora, quant
from ndjax.runtime.errors import ConfigError

# Head dim 8 in the tiny model: blocks of 8 values per scale.
QLORA = {"lora": {"rank": 4, "alpha": 16.0, "quantize": "nf4", "quant_block": 8}}
BASE_WEIGHTS = {("attn", "wq"), ("attn", "wk"), ("attn", "wv"), ("attn", "wo"),
                ("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down")}


def test_nf4_levels_are_qloras_normal_quantiles():
    """bitsandbytes' create_normal_map(offset=0.9677083), step by step: the quantiles of
    N(0, 1) at float32 linspaces, 8 positive, 7 negative and 0, over the largest."""
    offset, ppf = 0.9677083, statistics.NormalDist().inv_cdf
    positive = [ppf(p) for p in torch.linspace(offset, 0.5, 9)[:-1].tolist()]
    negative = [-ppf(p) for p in torch.linspace(offset, 0.5, 8)[:-1].tolist()]
    values = np.sort(np.array(positive + [0.0] + negative, np.float32))
    assert np.array_equal((values / values.max()).view(np.uint32), quant.NF4.view(np.uint32))


def _reference_quantize(w: np.ndarray, kind: str, block: int):
    """A plain reference: per block of the last axis, the absmax; NF4 the nearest level
    (argmin of the distance) packed high nibble first, scaled by the absmax; int8
    round(127 x / absmax), scaled by absmax x float32(1/127)."""
    x = w.astype(np.float32).reshape(*w.shape[:-1], -1, block)
    absmax = np.abs(x).max(-1)
    unit = x / np.where(absmax == 0, 1, absmax)[..., None]
    if kind == "int8":
        return (np.round(unit * 127).astype(np.int8).reshape(w.shape),
                absmax * np.float32(1 / 127))
    idx = np.abs(unit[..., None] - quant.NF4).argmin(-1).reshape(w.shape).astype(np.uint8)
    return idx[..., ::2] * 16 + idx[..., 1::2], absmax


def _reference_dequantize(codes, absmax, kind, block):
    if kind == "int8":  # the scale is the step, absmax / 127
        unit = codes.astype(np.float32)
    else:
        unit = quant.NF4[np.stack([codes // 16, codes % 16], -1).reshape(*codes.shape[:-1], -1)]
    return (unit.reshape(*unit.shape[:-1], -1, block) * absmax[..., None]).reshape(unit.shape)


@pytest.mark.parametrize("kind", quant.KINDS)
def test_quantize_and_read_back_match_the_reference_and_stay_within_the_bound(kind):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (3, 16, 64)).astype(np.float32)
    w[0, 0, :8] = 0  # an all-zero block reads back as zeros
    q = quant.QuantConfig(kind, 8)
    ref_codes, ref_absmax = _reference_quantize(w, kind, 8)
    want = _reference_dequantize(ref_codes, ref_absmax, kind, 8)
    for xp in (np, jnp):  # the host import's numpy and the devices' jax
        codes, scales = (np.asarray(a) for a in quant.quantize(xp.asarray(w), q))
        assert codes.dtype == ref_codes.dtype and np.array_equal(codes, ref_codes)
        assert np.array_equal(scales, ref_absmax)
        back = np.asarray(quant.dequantize(xp.asarray(codes), xp.asarray(scales), q))
        assert np.array_equal(back.view(np.uint32), want.view(np.uint32))
    assert codes.shape == q.shapes(w.shape)[0] and scales.shape == q.shapes(w.shape)[1]
    assert not back[0, 0, :8].any()
    # The bound: int8 is off by half a step (absmax / 254); NF4 by half the gap between
    # the two levels around the value (at most (1 - 0.7229568) / 2 of the absmax).
    absmax = np.repeat(ref_absmax * (127 if kind == "int8" else 1), 8, axis=-1)
    err = np.abs(back - w)
    if kind == "int8":
        bound = absmax / 254
    else:
        unit = w / np.where(absmax == 0, 1, absmax)
        above = np.searchsorted(quant.NF4, unit).clip(1, 15)
        bound = absmax * (quant.NF4[above] - quant.NF4[above - 1]) / 2
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    assert err.max() > 0.5 * bound.max()  # the bound is met, not loose


def test_a_qlora_step_is_a_lora_step_on_the_read_back_base(cpu_devices):
    """The adapters' gradients of a QLoRA step equal those of LoRA over a float32 base
    holding the read-back weights (1e-6 of the largest); against the unquantized base
    they differ by about NF4's own error, measured on these weights. The base is held
    as codes: 4.5 bits a weight with float32 scales over 8 values (bfloat16's 16)."""
    one = jax.devices()[:1]
    exp = Experiment.from_config(tiny_config(model=QLORA), one)
    init = jax.device_get(exp.init_state())
    layers = init.params["layers"]
    assert {(m, w) for m in layers for w in layers[m] if quant.is_quantized(layers[m][w])} \
        == BASE_WEIGHTS
    assert layers["attn"]["wq"]["codes"].dtype == np.uint8
    g = first_step_grads(exp, init)

    f32 = {"lora": {k: v for k, v in QLORA["lora"].items() if k.startswith(("rank", "alpha"))},
           "param_dtype": "float32"}
    plain = Experiment.from_config(tiny_config(model=f32), one)
    plain_init = jax.device_get(plain.init_state())
    read_back = init.replace(params=jax.device_get(quant.dequantized(init.params,
                                                                     exp.model_cfg.lora.quant)),
                             opt_state=plain_init.opt_state)
    g_read_back = first_step_grads(plain, read_back)
    # The same weights and the same matmuls; only where XLA fuses the read-back into the
    # step differs, so float32 sums may round apart: ~8 ulps of the largest gradient.
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_read_back), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())

    # The same seed draws the same float32 base the quantized one was made from.
    w_err = [np.linalg.norm(read_back.params["layers"][m][w] - plain_init.params["layers"][m][w])
             / np.linalg.norm(plain_init.params["layers"][m][w]) for m, w in BASE_WEIGHTS]
    g_full = first_step_grads(plain, plain_init)
    # (B = 0 at step 0, so A's gradients are 0: the error is B's.)
    g_err = max(np.linalg.norm(a - b) / np.linalg.norm(b)
                for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_full), strict=True)
                if np.abs(b).max() > 0)
    # Each of the 2 layers' 3 chained projections (q/k/v, o; gate/up, down) perturbs the
    # activations by about the weights' relative error, to first order: 4 x theirs.
    assert 0 < g_err <= 4 * max(w_err), (g_err, w_err)

    args = exp.compiled_step.memory_analysis().argument_size_in_bytes
    bf16 = Experiment.from_config(tiny_config(model={"lora": f32["lora"]}), one)
    assert args < bf16.compiled_step.memory_analysis().argument_size_in_bytes


def test_qlora_trains_like_one_device_on_fsdp_x_tensor(cpu_devices):
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2), model=QLORA),
                                 cpu_devices)
    init, params = assert_same_training(exp, QLORA)
    frozen = lora.split(params, True)[1]["layers"]["attn"]["wq"]
    assert np.array_equal(frozen["codes"], lora.split(init.params, True)[1]["layers"]["attn"]
                          ["wq"]["codes"])


@pytest.mark.parametrize("kind", quant.KINDS)
def test_import_quantizes_each_shard_like_the_whole_and_exports_merged(cpu_devices, tmp_path,
                                                                        kind):
    """model.init_from under QLoRA: the codes and scales are those of the checkpoint's
    float32 weights quantized whole, on fsdp x tensor; the merged export is the read-back
    base plus scale B A."""
    import safetensors.numpy
    from test_hf import FSDP_TP, config_for, make_hf

    from ndjax.runs import hf

    make_hf(tmp_path / "base")
    config = config_for(tmp_path / "base", mesh=FSDP_TP)
    config.model.lora.update(dict(rank=4, alpha=16.0, quantize=kind, quant_block=8))
    exp = Experiment.from_config(config, cpu_devices)
    params = jax.device_get(exp.init_state().params)
    q = exp.model_cfg.lora.quant
    files = safetensors.numpy.load_file(tmp_path / "base" / "model.safetensors")
    stored = params["layers"]["mlp"]["w_down"]
    for i in range(2):  # HF's (out, in) matrix is ndjax's (in, out) weight, transposed
        codes, scales = quant.quantize(files[f"model.layers.{i}.mlp.down_proj.weight"].T, q)
        assert np.array_equal(stored["codes"][i], codes)
        assert np.array_equal(stored["scales"][i], scales)

    hf.export(jax.device_put(params, exp.state_sharding.params), exp.model_cfg,
              str(tmp_path / "merged"), "float32")
    merged = safetensors.numpy.load_file(tmp_path / "merged" / "model.safetensors")
    down = quant.dequantize(stored["codes"][1], stored["scales"][1], q)
    a, b = (params["layers"]["mlp"]["lora_down"][x][1] for x in "ab")
    # numpy's A @ B against XLA's, in float32 on weights of ~0.2: a few ulps (as
    # test_lora.py's merged export).
    np.testing.assert_allclose(merged["model.layers.1.mlp.down_proj.weight"].T,
                               down + 4.0 * a @ b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("lora_fields, model, says", [
    (dict(quantize="nf4"), {}, "model.lora.rank is unset"),
    (dict(rank=4, quantize="nf4", quant_block=16), {},
     "model.lora.quant_block=16: .* head_dim=8 .* use model.lora.quant_block=8"),
    (dict(rank=4, quantize="nf4", quant_block=3), {}, "quant_block=3"),
    (dict(rank=4, quantize="int4"), {}, "model.lora.quantize"),
    (dict(rank=4, quantize="nf4", quant_block=8, target_modules="q_proj"),
     dict(family="qwen2_moe", n_experts=4, experts_per_token=2, moe_ffn_dim=32,
          shared_expert_dim=36), "model shared_expert_dim=36 is not a multiple of 8"),
], ids=["without_rank", "block_past_head_dim", "odd_block", "unknown_kind", "shared_expert"])
def test_bad_quantization_is_one_line(lora_fields, model, says):
    config = tiny_config(model={"lora": lora_fields, **model})
    with pytest.raises(ConfigError, match=says) as e:
        Experiment.from_config(config, jax.devices()[:1])
    assert "\n" not in str(e.value)


def test_qlora_on_a_mixture_of_experts_quantizes_its_experts(cpu_devices, tmp_path):
    """Qwen 2 MoE under QLoRA: every expert's projections, and the shared expert's, are
    stored as the checkpoint's weights quantized whole, read shard by shard on fsdp x
    expert (the router and the shared expert's gate are kept as they are), and it
    trains like one device (losses rtol 1e-5), the codes untouched."""
    import safetensors.numpy
    from test_families import BASE, make_family_hf
    from test_hf import config_for

    make_family_hf(tmp_path / "moe", "qwen2_moe")

    def exp(mesh, devices):
        config = config_for(tmp_path / "moe", mesh=mesh)
        config.model.vocab_size = BASE["vocab_size"]  # (the synthetic data's)
        config.model.lora.update(dict(rank=4, alpha=16.0, target_modules="q_proj,o_proj",
                                      quantize="nf4", quant_block=8))
        return Experiment.from_config(config, devices)

    one, split = exp(None, cpu_devices[:1]), exp(dict(fsdp=2, expert=4), cpu_devices)
    init = jax.device_get(split.init_state())
    mlp = init.params["layers"]["mlp"]
    assert not quant.is_quantized(mlp["router"]) and not quant.is_quantized(mlp["shared_gate"])
    assert all(quant.is_quantized(m[w]) for m in (mlp, mlp["shared"])
               for w in ("w_gate", "w_up", "w_down"))
    files = safetensors.numpy.load_file(tmp_path / "moe" / "model.safetensors")
    for layer, expert in ((0, 1), (1, 3)):
        codes, scales = quant.quantize(
            files[f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"].T,
            split.model_cfg.lora.quant)
        assert np.array_equal(mlp["w_down"]["codes"][layer, expert], codes)
        assert np.array_equal(mlp["w_down"]["scales"][layer, expert], scales)
    codes, _ = quant.quantize(files["model.layers.1.mlp.shared_expert.up_proj.weight"].T,
                              split.model_cfg.lora.quant)
    assert np.array_equal(mlp["shared"]["w_up"]["codes"][1], codes)
    (want, _), (losses, params) = run_steps(one, init), run_steps(split, init)
    np.testing.assert_allclose(losses, want, rtol=1e-5)  # the layout standard (f32 losses)
    assert abs(losses[2] - losses[0]) > 1e-4  # it trained
    assert np.array_equal(params["layers"]["mlp"]["w_up"]["codes"], mlp["w_up"]["codes"])


def test_qlora_generates_as_transformers_does_on_the_read_back_base(tmp_path):
    """``ndjax generate`` of a QLoRA model (fresh adapters) from an HF directory: the
    greedy tokens of transformers' model whose projections hold the read-back weights."""
    from test_generate import N_NEW, hf_greedy, prompts, write_tokenizer
    from test_hf import make_hf

    from ndjax.verbs.generate import load

    model = make_hf(tmp_path)
    write_tokenizer(tmp_path)
    ids = prompts()
    unquantized = hf_greedy(model, ids)
    q = quant.QuantConfig("nf4", 8)
    with torch.no_grad():  # HF's (out, in) matrices: ndjax's weights transposed
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                back = quant.dequantize(*quant.quantize(p.numpy().T, q), q).T
                p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    m = load(hf_dir=str(tmp_path), devices=jax.devices()[:1], overrides={
        "model.lora.rank": 4, "model.lora.quantize": "nf4", "model.lora.quant_block": 8,
        "model.param_dtype": "float32"})
    want = hf_greedy(model, ids)
    assert want != unquantized  # NF4's error shows in these tokens: the match means something
    assert m.generator(N_NEW)(ids) == want
