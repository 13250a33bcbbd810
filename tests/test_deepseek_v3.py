"""DeepSeek V3 beyond the families' suite (tests/test_families.py: logits, packed rows,
layouts, export and greedy generation against transformers): its router against
transformers' own, and auxiliary-loss-free balancing, the bias after each of 5 steps
against a plain reference, on every layout and across a resume."""

import functools
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
from conftest import tiny_config
from helpers import host_batches, run_steps
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from ndjax.experiment import Experiment
from ndjax.models import moe
from ndjax.runs import hf


@pytest.mark.parametrize("groups, top_groups, renormalise", [(1, 1, True), (4, 2, True),
                                                              (8, 3, False)])
def test_routing_is_transformers(groups, top_groups, renormalise):
    """``moe.route`` with sigmoid scores, the load-balancing bias (large enough to change
    the choice), group-limited top-k and the routed scaling factor chooses the experts
    transformers' DeepseekV3TopkRouter chooses, with its weights (float32)."""
    n, k, dim, tokens = 16, 4, 32, 64
    config = DeepseekV3Config(n_routed_experts=n, num_experts_per_tok=k, hidden_size=dim,
                              n_group=groups, topk_group=top_groups,
                              norm_topk_prob=renormalise, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.2)
    x = torch.randn(tokens, dim)
    with torch.no_grad():
        logits, want_weights, want_experts = router(x)
    scores = 1 / (1 + np.exp(-logits.numpy()))
    choice = scores + router.e_score_correction_bias.numpy()
    experts, weights = moe.route(scores, k, renormalise, choice, groups, top_groups, 2.5)
    order = np.argsort(np.asarray(experts), axis=-1)
    want_order = np.argsort(want_experts.numpy(), axis=-1)
    got_e = np.take_along_axis(np.asarray(experts), order, -1)
    np.testing.assert_array_equal(got_e, np.take_along_axis(want_experts.numpy(), want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_weights.numpy(), want_order, -1),
                               rtol=1e-6, atol=1e-7)
    # The bias changed some choice (or this would test top-k of the scores alone).
    plain = np.sort(np.asarray(moe.route(scores, k, renormalise)[0]), -1)
    assert (plain != got_e).any()


RATE = 0.01  # the bias's step: large enough to move the choice within 5 steps


def bias_config(mesh=None, steps=5):
    """The tiny DeepSeek V3 preset (MLA, a dense first layer, grouped routing, a shared
    expert) on the synthetic data, the bias moving by RATE per step."""
    c = tiny_config(mesh=mesh, train=dict(steps=steps))
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta"):
        c.model[field] = None
    c.model.update(family="deepseek_v3", preset="tiny", vocab_size=256, score_bias_rate=RATE)
    return c


def bias_steps(exp, init, steps=5):
    """[(parameters before the step (host), its batch, the bias after it)] per step."""
    state = jax.device_put(init, exp.state_sharding)
    out = []
    for batch in host_batches(exp.config, steps):
        before = jax.device_get(state.params)
        state, _ = exp.compiled_step(state, exp.device_batch(batch))
        out.append((before, batch, np.asarray(state.params["layers"]["mlp"]["score_bias"])))
    return out


def transformers_counts(exp, params, batch, directory):
    """Per MoE layer, how many of the batch's tokens chose each expert, by transformers'
    DeepseekV3ForCausalLM on the exported parameters (its router's own top-k)."""
    hf.export(jax.device_put(params, jax.devices()[0]), exp.model_cfg, str(directory),
              "float32")
    model = DeepseekV3ForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    gates = [x.mlp.gate for x in model.model.layers if hasattr(x.mlp, "gate")]
    counts = np.zeros((len(gates), model.config.n_routed_experts), np.float32)

    def hook(module, args, output, layer):
        counts[layer] += np.bincount(output[2].reshape(-1).numpy(), minlength=counts.shape[1])
    for i, gate in enumerate(gates):
        gate.register_forward_hook(functools.partial(hook, layer=i))
    inputs, segments = np.asarray(batch["inputs"]), np.asarray(batch["segment_ids"])
    with torch.no_grad():  # each document alone, as packing computes it; padding not counted
        for row, seg in zip(inputs, segments):
            for doc in sorted(set(seg.tolist()) - {0}):
                model(torch.tensor(row[seg == doc][None], dtype=torch.long))
    return counts


def test_the_bias_moves_as_a_plain_reference_on_every_layout_and_across_a_resume(
        cpu_devices, tmp_path):
    """Auxiliary-loss-free balancing over 5 steps: after each, every MoE layer's bias is
    the bias before it plus RATE x sign(mean - count) per expert, the counts those of
    transformers' router on the step's parameters and batch (each packed document alone);
    fsdp x expert x tensor moves it identically; a run resumed from step 3 ends with the
    bias of the uninterrupted run, bit for bit. The optimizer never moves it (no weight
    decay on it: the update is the rule's alone)."""
    one = Experiment.from_config(bias_config(), cpu_devices[:1])
    assert one.model_cfg.first_k_dense == 1 and one.model_cfg.n_group > 1
    init = jax.device_get(one.init_state())
    steps = bias_steps(one, init)
    moved = False
    for i, (before, batch, after) in enumerate(steps):
        counts = transformers_counts(one, before, batch, tmp_path / f"step{i}")
        bias = np.asarray(before["layers"]["mlp"]["score_bias"])
        want = bias + RATE * np.sign(counts.mean(-1, keepdims=True) - counts)
        np.testing.assert_allclose(after, want, rtol=0, atol=1e-7, err_msg=f"step {i + 1}")
        moved |= bool((after != bias).any())
    assert moved
    split = Experiment.from_config(bias_config(dict(fsdp=2, expert=2, tensor=2)), cpu_devices)
    for (_, _, want), (_, _, got) in zip(steps, bias_steps(split, init)):
        np.testing.assert_array_equal(got, want)

    from ndjax.training.loop import train

    def run(workdir, resume="auto"):
        c = bias_config()
        c.checkpoint.every, c.checkpoint.resume, c.log.tensorboard = 3, resume, False
        c.export.hf_dir = str(workdir / "hf")
        train(c, str(workdir), cpu_devices[:1], verbose=False)
        return safetensors.numpy.load_file(workdir / "hf" / "model.safetensors")

    whole = run(tmp_path / "whole")
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "3",
                    tmp_path / "resumed" / "checkpoints" / "3")
    resumed = run(tmp_path / "resumed", resume="3")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert whole[name].any()
    for key in (k for k in whole if k.endswith("e_score_correction_bias")):
        np.testing.assert_array_equal(resumed[key], whole[key])


# LoRA over an unquantized base is the same adapters' code (tests/test_lora.py); QLoRA
# adds MLA's quantized weights and the two stacks' MLPs.
@pytest.mark.parametrize("quantize", ["nf4"], ids=["qlora"])
def test_lora_and_qlora_on_a_checkpoint_train_like_one_device(cpu_devices, tmp_path, quantize):
    """A DeepSeek V3 checkpoint under LoRA on o_proj (latent attention's other projections
    take none yet: refused in one line) and QLoRA (MLA's five weights, the dense layer's
    MLP, the experts and the shared expert stored quantized): fsdp x expert x tensor
    trains like one device (3 AdamW steps, losses rtol 1e-5); the load-balancing bias
    still moves, and is checkpointed with the adapters."""
    from test_families import BASE, make_family_hf
    from test_hf import config_for

    from ndjax.models import lora, quant
    from ndjax.runtime.errors import ConfigError

    make_family_hf(tmp_path / "ds", "deepseek_v3")

    def config(mesh, targets="o_proj"):
        c = config_for(tmp_path / "ds", mesh=mesh)
        c.model.vocab_size = BASE["vocab_size"]  # (the synthetic data's)
        c.model.lora.update(dict(rank=4, alpha=16.0, target_modules=targets))
        if quantize:
            c.model.lora.update(quantize=quantize, quant_block=4)
        return c

    with pytest.raises(ConfigError, match=r"^model.lora.target_modules='all-linear': .*latent "
                                          r"attention.*target_modules='o_proj'\.$"):
        Experiment.from_config(config(None, "all-linear"), cpu_devices[:1])
    one = Experiment.from_config(config(None), cpu_devices[:1])
    split = Experiment.from_config(config(dict(fsdp=2, expert=2, tensor=2)), cpu_devices)
    init = jax.device_get(split.init_state())
    layers = init.params["layers"]
    if quantize:
        assert all(quant.is_quantized(layers["attn"][w])
                   for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
        assert quant.is_quantized(init.params["dense_layers"]["mlp"]["w_up"])
        assert quant.is_quantized(layers["mlp"]["w_down"])
        assert not quant.is_quantized(layers["mlp"]["router"])
    assert "score_bias" in lora.trainable(init.params, True)["layers"]["mlp"]
    (want, _), (losses, params) = run_steps(one, init), run_steps(split, init)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert abs(losses[2] - losses[0]) > 1e-4
    assert (params["layers"]["mlp"]["score_bias"] != layers["mlp"]["score_bias"]).any()
