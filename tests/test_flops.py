import dataclasses
import functools
import math

import jax
import pytest
from conftest import tiny_config
from jax.extend import core as jcore

from ndjax.experiment import Experiment
from ndjax.hardware import roofline
from ndjax.hardware.flops import flops_per_token, peak_tflops
from ndjax.models.decoder import DecoderConfig
from ndjax.models.lora import LoraConfig
from ndjax.models.registry import config_from_preset
from ndjax.parallel import rules as rules_lib
from ndjax.step.train_step import train_step


def test_flops_per_token_by_hand():
    cfg = DecoderConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16)
    seq = 5
    # Per layer: q 8x8=64, k 8x4=32, v 32, o 64, gate/up/down 3x8x16=384 -> 576.
    matmul_params = 2 * 576
    head = 8 * 100
    # Causal: query i sees i keys (1..5) -> 15 pairs per head; QK^T + PV = 2 x
    # (2 x head_dim) FLOPs per pair forward, x3 for training.
    attention = 2 * 2 * 15 * (2 * 2 * 4) * 3 / seq   # layers x heads x pairs x flops, per token
    expected = 6 * matmul_params + 6 * head + attention
    assert flops_per_token(cfg, seq) == pytest.approx(expected)
    # LoRA rank 2 on q and down: the frozen weights form their input's gradient only (4
    # FLOPs a weight), the adapters all three matmuls: 6 x 2 x ((8 + 8) + (16 + 8)) a layer.
    lora_cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=2, alpha=4.0, targets=("q", "down")))
    adapters = 2 * 6 * 2 * (16 + 24)
    assert flops_per_token(lora_cfg, seq) == pytest.approx(
        4 * matmul_params + 4 * head + adapters + attention)


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA B200", 2250.0), ("cpu", None), ("TFRT_CPU_0", None),
])
def test_peak_table(kind, peak):
    assert peak_tflops(kind) == peak


def test_peak_override():
    assert peak_tflops("cpu", override=1.5) == 1.5


# The forward einsums of the block's weights (ndjax.models.layers.project), by the
# matmuls of the roofline's breakdown they are: a dot of the train step named by one
# of these (not under a transpose) is a weight's forward matmul, run once in the
# forward pass plus once for each recomputation.
WEIGHT_FORWARD = {"bsd,dhk->bshk": ("q", "k", "v"), "bshk,hkd->bsd": ("o",),
                  "bsd,df->bsf": ("gate", "up"), "bsf,fd->bsd": ("down",)}


def _step_dot_flops(remat: str, impl: str = "dense"
                    ) -> tuple[dict[str, int], DecoderConfig, int, int]:
    """(FLOPs of every dot_general of the traced train step, by the einsum that made it
    (weight forward matmuls) or "other" (backward matmuls, the loss, attention); the
    model; seq_len; tokens per step)."""
    # Unrolled layers: a scan's body would count once, not once per layer.
    exp = Experiment.from_config(tiny_config(
        model=dict(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, scan_layers=False,
                   remat=remat, attn_impl=impl),
        train=dict(seq_len=64, batch_size=2)), jax.devices()[:1])
    step = functools.partial(train_step, exp.features, exp.optimizer, exp.schedule,
                             exp.step_options, None)
    with rules_lib.use(exp.rules):
        jaxpr = jax.make_jaxpr(step)(exp.abstract_state, exp.abstract_batch).jaxpr

    flops: dict[str, int] = {}

    def walk(jaxpr, times):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
                label = str(eqn.source_info.name_stack).split("/")[-1]
                key = label if label in WEIGHT_FORWARD else "other"
                flops[key] = flops.get(key, 0) + times * 2 * math.prod(out) * math.prod(
                    lhs[i] for i in contract)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                        inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                        walk(inner, times * (eqn.params["length"]
                                             if eqn.primitive.name == "scan" else 1))

    walk(jaxpr, 1)
    train = exp.config.train
    return flops, exp.model_cfg, train.seq_len, train.batch_size * train.seq_len


# The kernels a CPU runs (the fused GPU ones: tests/test_attention.py counts their
# forward runs per policy, tests/test_gpu_compile.py cuDNN's compiled calls).
@pytest.mark.parametrize("impl", ["dense", "blocked", "tiled"])
def test_remat_recompute_is_what_the_train_step_reruns(impl):
    """roofline.recomputed_forward_flops, per policy, against the dots of the traced
    step less those of remat=none (which reruns no weight matmul): exact for every
    weight matmul. The attention itself (QK^T, PV) is rerun only under full, by every
    kernel; how much of it depends on the kernel (dense reruns PV; tiled's loop body
    counts once), so it is checked for presence, and priced at the causal forward
    that ndjax.hardware.flops counts."""
    base, cfg, seq_len, tokens = _step_dot_flops("none", impl)
    for remat in ("save_proj", "save_attn", "full"):
        measured = _step_dot_flops(remat, impl)[0]
        priced = roofline.recomputed_forward_flops(cfg, seq_len, remat)
        for label, parts in WEIGHT_FORWARD.items():
            rerun = measured.get(label, 0) - base.get(label, 0)
            assert rerun == tokens * sum(priced.get(p, 0) for p in parts), (remat, label)
        attention_rerun = measured["other"] - base["other"]
        assert (attention_rerun > 0) == (priced.get("attention", 0) > 0), remat


def test_estimate_prices_each_remat_policy():
    """Without the model's own figure (the planner's call), each policy is priced at
    what it reruns in Llama 3 8B at 4096 tokens; none < save_proj < save_attn < full.
    save_attn reruns every projection but the MLP's down (its memory saving costs
    most of full's compute); it was priced as rerunning nothing."""
    link = roofline.Link({}, {})
    h100 = roofline.HARDWARE["h100"]
    cfg = config_from_preset("llama", "llama3_8b")
    model_flops = flops_per_token(cfg, 4096) * 4096

    def compute_s(remat, **kw):
        return roofline.estimate(h100, link, model_flops, 4096, 8, remat, **kw).compute_s

    times = [compute_s(r) for r in ("none", "save_proj", "save_attn", "full")]
    assert times == sorted(times) and len(set(times)) == 4, times
    for remat in ("none", "save_proj", "save_attn", "full"):
        rerun = sum(roofline.recomputed_forward_flops(cfg, 4096, remat).values()) * 4096
        assert compute_s(remat) == pytest.approx(compute_s("none") * (1 + rerun / model_flops))
        # The model's own figure, when given, is what is priced.
        assert compute_s(remat, recompute_flops=rerun) == pytest.approx(compute_s(remat))
    assert 1.15 < times[2] / times[0] < times[3] / times[0] < 4 / 3
    # offload reruns what full does; its layer inputs cross PCIe twice (out and back).
    assert compute_s("offload") == compute_s("full")
    e = roofline.estimate(h100, link, model_flops, 4096, 8, "offload", host_bytes=32e9)
    assert e.host_s == pytest.approx(2 * 32e9 / (h100.pcie_gbs * 1e9))
    assert e.communication_s == pytest.approx(e.host_s)
