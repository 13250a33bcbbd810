"""Storage dtypes: bfloat16 parameters (model.param_dtype) and AdamW moments
(train.opt_state_dtype), with float32 optimizer arithmetic."""

import json
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import tiny_config
from helpers import run_steps
from test_memory_and_hlo import batch_bytes_per_device

from ndjax.experiment import Experiment
from ndjax.export import run_config
from ndjax.report import sharding_table

FSDP_TP = dict(fsdp=4, tensor=2)
BF16 = dict(model=dict(param_dtype="bfloat16"), train=dict(opt_state_dtype="bfloat16"))
BF16_MOMENTS = dict(train=dict(opt_state_dtype="bfloat16"))


def adam_states(opt_state):
    """The ScaleByAdamState(s) inside an optimizer state (of arrays or shardings)."""
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    return [s for s in leaves if isinstance(s, optax.ScaleByAdamState)]


def bf16_ulp(x: np.ndarray) -> float:
    """bfloat16's spacing at the largest magnitude in ``x``."""
    top = float(np.max(np.abs(x)))
    return 2.0 ** (math.floor(math.log2(top)) - ml_dtypes.finfo(ml_dtypes.bfloat16).nmant)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_moments_are_sharded_like_their_parameters(param_dtype):
    config = tiny_config(mesh=FSDP_TP, model=dict(param_dtype=param_dtype), **BF16_MOMENTS)
    exp = Experiment.from_config(config)
    params = exp.state_sharding.params
    # Not vacuous: most parameters are split, so a replicated moment would show.
    assert sum(not s.is_fully_replicated for s in jax.tree.leaves(params)) > 5
    (adam,) = adam_states(exp.state_sharding.opt_state)
    for moments in (adam.mu, adam.nu):
        assert jax.tree.structure(moments) == jax.tree.structure(params)
        jax.tree.map(lambda m, p: (m == p) or pytest.fail(f"{m} != {p}"), moments, params)
    assert adam.count.is_fully_replicated

    state = exp.init_state()  # the arrays themselves: that layout, and stored in bfloat16
    (adam,) = adam_states(state.opt_state)
    for moments in (adam.mu, adam.nu):
        for m, p in zip(jax.tree.leaves(moments), jax.tree.leaves(state.params)):
            assert m.sharding == p.sharding and m.dtype == jnp.bfloat16
            assert p.dtype == jnp.dtype(param_dtype)


def test_bf16_training_matches_one_device():
    """bf16 parameters + bf16 moments on fsdp=4 x tensor=2 = the same config on one device.

    Tolerance: the layouts differ only in the order of float32 sums (~1e-7
    relative), but an update that lands near a rounding boundary can round to
    the neighbouring bfloat16 value on one side and not the other: one ulp, which
    later steps carry along. So parameters may differ by a ulp or two at their
    tensor's largest magnitude (atol = 2 ulps of it), while a layout bug (a moment
    on the wrong shard, a missing reduction) moves them by ~lr = 1e-2, tens of
    ulps. Losses are float32 sums over parameters that differ in a few entries by
    one ulp: rtol 1e-4, still ~100x below the change of the loss per step.
    """
    one = Experiment.from_config(tiny_config(**BF16), jax.devices()[:1])
    init = jax.device_get(one.init_state())
    ref_losses, ref_params = run_steps(one, init)
    losses, params = run_steps(Experiment.from_config(tiny_config(mesh=FSDP_TP, **BF16)), init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]

    def close(a, b):
        assert a.dtype == b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=2 * bf16_ulp(b))

    jax.tree.map(close, params, ref_params)
    # Trained for real: the embedding moved by much more than the tolerance.
    embed, start = (np.asarray(p["embed"], np.float32) for p in (params, init.params))
    assert np.abs(embed - start).max() > 10 * 2 * bf16_ulp(start)


def test_bf16_moments_track_float32_moments():
    """float32 parameters and compute, moments stored in bfloat16 vs float32.

    Each stored moment is rounded by at most 2^-9 relative, so each update is off
    by < 1% of itself, and the loss by < 1% of what it moves per step (a few
    percent here): rtol 1e-3 is loose. The rounding first enters the second
    update (the first is computed from zero moments before they are stored), so
    the first two losses agree to float32 noise.
    """
    f32 = Experiment.from_config(tiny_config(mesh=FSDP_TP))
    bf16 = Experiment.from_config(tiny_config(mesh=FSDP_TP, **BF16_MOMENTS))
    (adam,) = adam_states(bf16.abstract_state.opt_state)
    assert {m.dtype for m in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    ref_losses, _ = run_steps(f32)
    losses, params = run_steps(bf16)
    np.testing.assert_allclose(losses[:2], ref_losses[:2], rtol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype(np.float32)}


def test_bf16_state_halves_the_step_arguments():
    """bf16 parameters + moments: the compiled step's per-device arguments (batch
    aside) are bf16/f32 of the float32 figure, within 10% (the int32 step counters
    do not shrink)."""
    def state_args(overrides):
        exp = Experiment.from_config(tiny_config(mesh=FSDP_TP, **overrides))
        args = exp.compiled_step.memory_analysis().argument_size_in_bytes
        return args - batch_bytes_per_device(exp)

    ratio = state_args(BF16) / state_args({})
    half = jnp.dtype(jnp.bfloat16).itemsize / jnp.dtype(jnp.float32).itemsize
    assert abs(ratio - half) / half < 0.1, ratio


def test_sharding_table_reports_bf16():
    def table(overrides):
        return sharding_table(Experiment.from_config(tiny_config(mesh=FSDP_TP, **overrides)),
                              compile_step=False)

    def per_device(text, what):
        value, unit = re.search(rf"^{what}: .*?([\d.]+) (B|KiB|MiB) per device", text,
                                re.M).groups()
        return float(value) * 1024 ** ["B", "KiB", "MiB"].index(unit)

    f32, bf16 = table({}), table(BF16)
    assert re.search(r"^layers/attn/wq .* bfloat16 ", bf16, re.M)
    assert "per device (bfloat16)" in bf16 and "(moments bfloat16)" in bf16
    assert "per device (float32)" in f32 and "(moments float32)" in f32
    half = jnp.dtype(jnp.bfloat16).itemsize / jnp.dtype(jnp.float32).itemsize
    for what in ("parameters", "optimizer state"):  # within the table's 0.1 rounding
        assert per_device(bf16, what) / per_device(f32, what) == pytest.approx(half, rel=0.02)


def test_export_reads_a_config_saved_before_the_dtype_fields(tmp_path):
    saved = json.loads(tiny_config().to_json_best_effort())
    del saved["model"]["param_dtype"], saved["train"]["opt_state_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    config = run_config(str(tmp_path))
    assert (config.model.param_dtype, config.train.opt_state_dtype) == ("float32", "float32")
    assert config.model.dim == tiny_config().model.dim
