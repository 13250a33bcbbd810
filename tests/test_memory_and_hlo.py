"""What the compiled programs hold per device, and what they contain."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import host_batches

from ndjax.experiment import Experiment


def state_bytes(exp):
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(exp.abstract_state))


def batch_bytes_per_device(exp):
    return sum(math.prod(exp.batch_sharding.shard_shape(b.shape)) * b.dtype.itemsize
               for b in exp.abstract_batch.values())


@pytest.mark.parametrize("mesh, model, degree", [
    (dict(fsdp=8), {}, 8),
    (dict(tensor=8), dict(n_kv_heads=8), 8),
    (dict(fsdp=4, tensor=2), {}, 8),
])
def test_step_arguments_are_sharded(mesh, model, degree):
    """Parameters + optimizer state per device = total / shard degree (within 5%).

    What is not split (norm scales, step counters) is well under 5% here.
    """
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=model))
    args = exp.compiled_step.memory_analysis().argument_size_in_bytes
    per_device_state = args - batch_bytes_per_device(exp)
    expected = state_bytes(exp) / degree
    assert abs(per_device_state - expected) / expected < 0.05, (per_device_state, expected)


def test_init_creates_sharded_state_without_a_full_copy():
    """The compiled init's per-device output is 1/8 of the state: never a full copy."""
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2)))
    out = exp.compiled_init.memory_analysis().output_size_in_bytes
    total = state_bytes(exp)
    assert abs(out - total / 8) / (total / 8) < 0.05, (out, total)
    state = exp.init_state()
    wq = state.params["layers"]["attn"]["wq"]
    assert wq.sharding == exp.state_sharding.params["layers"]["attn"]["wq"]
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 16, 4, 8)}


def test_lowered_step_contains_the_logical_constraints():
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2)))
    text = exp.lower_step().as_text()
    constraints = re.findall(r"sdy.sharding_constraint .*? <@mesh, (\[.*?\])>", text)
    # Embedding output, per-layer q/k/v/attn/mlp activations and weights, logits.
    assert len(constraints) >= 20
    assert '[{"fsdp"}, {}, {"tensor"}]' in constraints   # logits: batch x vocab-parallel
    assert '[{"fsdp"}, {}, {"tensor"}, {}]' in constraints  # q: batch x heads
    assert '[{}, {"tensor"}, {}]' in constraints  # wq in compute: gathered over fsdp


def collectives(exp):
    hlo = exp.compiled_step.as_text()
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo))
            for op in ("all-gather", "all-reduce", "reduce-scatter", "collective-permute")}


def test_dp_only_all_reduces_and_fsdp_gathers():
    dp = collectives(Experiment.from_config(tiny_config(mesh=dict(replica=8))))
    fsdp = collectives(Experiment.from_config(tiny_config(mesh=dict(fsdp=8))))
    assert dp["all-gather"] == 0 and dp["all-reduce"] > 0
    # FSDP gathers weights just in time (once per weight, inside the layer loop).
    assert fsdp["all-gather"] >= 7


def test_single_device_step_has_no_collectives():
    exp = Experiment.from_config(tiny_config(), jax.devices()[:1])
    assert sum(collectives(exp).values()) == 0
    assert np.isfinite(exp.compiled_step.memory_analysis().temp_size_in_bytes)


def test_fsdp_keeps_no_gathered_weights_for_all_layers():
    """FSDP must gather each layer's weights in the backward pass again, not keep
    the gathered copies of all layers (a full unsharded model per device)."""
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=8), model=dict(n_layers=4)))
    hlo = exp.compiled_step.as_text()
    assert "f32[4,64,128]" not in hlo  # w_gate / w_up of all 4 layers, gathered
    assert "f32[4,8,128]" in hlo       # ... while their sharded stack is there


def test_fsdp_reduce_scatters_every_weight_gradient_in_f32():
    """bf16 compute, f32 parameters, fsdp=8: every weight's gradient crosses devices as
    a float32 reduce-scatter into its storage shard (1/8 of its float32 bytes per
    device, once), not as an all-reduce of the whole gradient cut afterwards, and
    the gradient the optimizer sees was summed in float32, never rounded to bf16.

    A weight gradient rounded to the compute dtype before it reached the storage
    layout forced the partitioner to finish the sum first: an all-reduce of every
    layer's whole gradient (2x a reduce-scatter's ring bytes), rounded on the way.
    """
    from ndjax.parallel import collectives as coll
    from ndjax.parallel import rules as rules_lib
    from ndjax.step.train_step import loss_and_grads

    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=8), model=dict(dtype="bfloat16")))
    # The step's gradients alone (the train step's collectives, less the update's).
    grad_shardings = exp.state_sharding.params
    with rules_lib.use(exp.rules):
        compiled = jax.jit(
            functools.partial(loss_and_grads, exp.features, exp.step_options,
                              grad_shardings=grad_shardings),
            in_shardings=(grad_shardings, exp.batch_sharding),
            out_shardings=(None, None, grad_shardings),
        ).lower(exp.abstract_state.params, exp.abstract_batch).compile()
    cs = [c for c in coll.collectives(compiled.as_text()) if c.executed]
    shapes = exp.param_shapes
    sharded = [s for s, sh in zip(jax.tree.leaves(shapes),
                                  jax.tree.leaves(exp.state_sharding.params))
               if math.prod(sh.shard_shape(s.shape)) < math.prod(s.shape)]
    # Layer weights are stacked (layers, ...): each layer's own shard, once per layer.
    expected = sum(math.prod(s.shape) * 4 for s in sharded) / 8
    scattered = sum(c.bytes * c.executed for c in cs
                    if c.kind == "reduce-scatter" and c.dtype == "f32")
    assert abs(scattered - expected) / expected < 0.01, (scattered, expected)
    smallest = min(math.prod(s.shape[1:]) * 4 for s in jax.tree.leaves(shapes["layers"])
                   if s.ndim > 2)  # one layer's smallest weight, whole, in f32
    whole = [(c.dtype, c.bytes) for c in cs if c.kind == "all-reduce" and c.bytes >= smallest]
    assert not whole, whole

    # Not rounded: a float32 sum of bf16 products is almost never a bf16 number. (Not
    # the embedding's: most of its rows sum one token's bf16 gradient, or none.)
    batch = exp.device_batch(host_batches(exp.config, 1)[0])
    grads = compiled(exp.init_state().params, batch)[2]
    grads = jax.device_get(grads)
    del grads["embed"]
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        g = np.asarray(g, np.float32)
        exact = np.mean(g == g.astype(jnp.bfloat16).astype(np.float32))
        assert exact < 0.2, (jax.tree_util.keystr(path), exact)


def _step_temp_and_dots(scan: bool, remat: str) -> tuple[int, int]:
    """(temporary bytes, dot instructions) of the compiled one-device step."""
    exp = Experiment.from_config(tiny_config(
        model=dict(n_layers=4, scan_layers=scan, remat=remat),
        train=dict(batch_size=8, seq_len=128)), jax.devices()[:1])
    compiled = exp.compiled_step
    return (compiled.memory_analysis().temp_size_in_bytes,
            len(re.findall(r"= \S+ dot\(", compiled.as_text())))


@pytest.mark.parametrize("scan", [False, True])
def test_remat_means_the_same_with_and_without_scan(scan):
    """Unrolled, XLA's CPU pipeline merged each layer's recomputation back into its
    forward pass (CSE after it removed jax's barriers): remat=full compiled to
    remat=none's memory. Now every policy keeps its memory, scanned or not: full
    holds a layer's input per layer, so it needs well under none's temporaries, and
    its step recomputes dots that none's does not (unrolled: the layers' forward
    dots once more; scanned, the loop body's are counted once)."""
    (none_temp, none_dots), (full_temp, full_dots) = (_step_temp_and_dots(scan, r)
                                                      for r in ("none", "full"))
    assert full_temp < 0.7 * none_temp, (none_temp, full_temp)
    assert full_dots > none_dots, (none_dots, full_dots)


def test_a_small_models_init_compiles_quickly_on_cpu(monkeypatch):
    """The init runs once: on a CPU, for a small model, XLA compiles it with LLVM's
    optimisations off (seconds less to the first step); the train step, never."""
    from ndjax.runtime import compiler
    used = []
    real = compiler.compile_step
    monkeypatch.setattr(compiler, "compile_step", lambda lowered, options=None, platform=None:
                        used.append(options) or real(lowered, options, platform))
    exp = Experiment.from_config(tiny_config(), jax.devices()[:1])
    exp.compiled_init  # noqa: B018
    exp.compiled_step  # noqa: B018
    assert used == [compiler.CPU_QUICK_OPTIONS, None]
    assert compiler.init_options("cpu", compiler.CPU_QUICK_INIT_MAX_PARAMS + 1) == {}
    assert compiler.init_options("gpu", 1000) == {}
