"""What the compiled programs hold per device, and what they contain."""

import math
import re

import jax
import numpy as np
import pytest
from conftest import tiny_config

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
