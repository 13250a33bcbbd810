"""GPT-OSS beyond the families' suite (tests/test_families.py: logits, packed rows, the
load-balancing loss, layouts, export and greedy generation against transformers): its
clamped SwiGLU against transformers' own, LoRA and QLoRA on its checkpoint across
layouts, and the Hub's MXFP4 experts."""

import jax
import numpy as np
import pytest
import torch
from helpers import run_steps
from test_families import BASE, make_family_hf
from test_hf import config_for
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from ndjax.experiment import Experiment
from ndjax.models import moe, quant
from ndjax.models.registry import config_from_preset


def test_clamped_swiglu_is_transformers():
    """``moe.gated`` of GPT-OSS on values on both sides of the limit (and at it) equals
    GptOssExperts._apply_gate of the same gate and up interleaved, in float32."""
    cfg = config_from_preset("gpt_oss", "tiny")
    rng = np.random.default_rng(0)
    gate, up = (rng.normal(0, 6.0, (64, 32)).astype(np.float32) for _ in range(2))
    gate[0, :4] = up[0, :4] = [7.0, -7.0, 7.5, -7.5]
    both = np.empty((64, 64), np.float32)
    both[:, 0::2], both[:, 1::2] = gate, up
    experts = GptOssExperts(GptOssConfig(num_local_experts=1, hidden_size=8,
                                         intermediate_size=32))
    want = experts._apply_gate(torch.tensor(both)).numpy()
    got = np.asarray(moe.gated(cfg)(gate, up))
    assert (np.abs(gate) > cfg.swiglu_limit).any() and (np.abs(up) > cfg.swiglu_limit).any()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# LoRA over an unquantized base is the same adapters' code (tests/test_lora.py runs it on
# every layout); QLoRA adds the quantized experts read from the interleaved checkpoint.
@pytest.mark.parametrize("quantize", ["nf4"], ids=["qlora"])
def test_lora_and_qlora_on_a_checkpoint_train_like_one_device(cpu_devices, tmp_path, quantize):
    """A GPT-OSS checkpoint under LoRA (q, k, v, o) and QLoRA (the experts' projections
    stored quantized, read from the interleaved gate_up_proj): fsdp x expert x tensor
    trains like one device (3 AdamW steps, losses rtol 1e-5), the base untouched; under
    QLoRA an expert's codes are the checkpoint's columns quantized."""
    model = make_family_hf(tmp_path / "gpt_oss", "gpt_oss")

    def exp(mesh, devices):
        config = config_for(tmp_path / "gpt_oss", mesh=mesh)
        config.model.vocab_size = BASE["vocab_size"]  # (the synthetic data's)
        config.model.lora.update(dict(rank=4, alpha=16.0,
                                      target_modules="q_proj,k_proj,v_proj,o_proj"))
        if quantize:
            config.model.lora.update(quantize=quantize, quant_block=8)
        return Experiment.from_config(config, devices)

    one, split = exp(None, cpu_devices[:1]), exp(dict(fsdp=2, expert=2, tensor=2), cpu_devices)
    init = jax.device_get(split.init_state())
    mlp = init.params["layers"]["mlp"]
    if quantize:
        assert all(quant.is_quantized(mlp[w]) for w in ("w_gate", "w_up", "w_down"))
        assert not quant.is_quantized(mlp["router"]) and not quant.is_quantized(mlp["b_up"])
        up = model.model.layers[1].mlp.experts.gate_up_proj[2, :, 1::2].detach().numpy()
        codes, scales = quant.quantize(up, split.model_cfg.lora.quant)
        assert np.array_equal(mlp["w_up"]["codes"][1, 2], codes)
        assert np.array_equal(mlp["w_up"]["scales"][1, 2], scales)
    (want, _), (losses, params) = run_steps(one, init), run_steps(split, init)
    np.testing.assert_allclose(losses, want, rtol=1e-5)  # the layout standard (f32 losses)
    assert abs(losses[2] - losses[0]) > 1e-4  # it trained
    for name in ("router", "b_gate", "sinks"):
        where = params["layers"]["attn" if name == "sinks" else "mlp"]
        was = init.params["layers"]["attn" if name == "sinks" else "mlp"]
        np.testing.assert_array_equal(where[name], was[name])  # frozen
