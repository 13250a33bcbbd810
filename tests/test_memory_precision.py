"""Memory and precision of the compiled step: bfloat16 FSDP, full remat, the chunked
loss, gradient accumulation.

Memory figures come from compiling ahead of time (nothing runs): the compiled
step's temporaries per device. Equalities are f32 against one device or k=1,
with test_layouts' tolerances (losses of 3 AdamW steps at rtol 1e-5, first-step
gradients): micro-batching and chunking only reorder float32 sums.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import (
    GRAD_RTOL,
    assert_same_training,
    first_step_grads,
    host_batches,
    partitioned_hlo,
    reference,
    run_steps,
)

from ndjax.experiment import Experiment
from ndjax.ops.cross_entropy import cross_entropy, loss_sums
from ndjax.parallel import rules as rules_lib
from ndjax.step.train_step import loss_and_grads


def temp_bytes(exp) -> int:
    return exp.compiled_step.memory_analysis().temp_size_in_bytes


# Weights dominate this shape (dim 256, 4 layers, 8 x 32 tokens): a kept copy of
# the gathered model (4 MiB in bf16 per layer) would stand out.
WEIGHT_HEAVY = dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1024)


def test_bf16_fsdp_needs_no_more_than_f32():
    """In bfloat16 with remat=none, FSDP keeps no gathered weights across layers:
    temporaries are at most the float32 figure (they were 2.2x it)."""
    def temp(dtype):
        return temp_bytes(Experiment.from_config(tiny_config(
            mesh=dict(fsdp=8), model=dict(WEIGHT_HEAVY, dtype=dtype, remat="none"))))
    assert temp("bfloat16") <= temp("float32")


def collective_types(hlo: str, op: str) -> set[str]:
    return set(re.findall(rf"= (\w+)\[[\d,]*\][^ ]* {op}\(", hlo))


def test_bf16_fsdp_gathers_bf16_and_reduces_f32():
    """Weights are cast before they are gathered (half the bytes of float32), and
    gradients are cast to float32 before they are reduce-scattered."""
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=8),
                                             model=dict(dtype="bfloat16")))
    hlo = partitioned_hlo(exp.lower_step())
    assert collective_types(hlo, "all-gather") == {"bf16"}
    # On CPU the partitioner writes a reduce-scatter as all-reduce + dynamic-slice;
    # with FSDP alone every all-reduce sums gradients (or the loss).
    assert collective_types(hlo, "all-reduce") | collective_types(hlo, "reduce-scatter") \
        == {"f32"}
    f32 = Experiment.from_config(tiny_config(mesh=dict(fsdp=8)))
    assert collective_types(partitioned_hlo(f32.lower_step()), "all-gather") == {"f32"}


def full_remat_temp(layers: int, rules: str = "default") -> int:
    return temp_bytes(Experiment.from_config(tiny_config(
        mesh=dict(fsdp=4, tensor=2), rules=rules,
        model=dict(dim=128, n_layers=layers, ffn_dim=256, dtype="bfloat16", remat="full"),
        train=dict(batch_size=8, seq_len=256))))


def test_full_remat_keeps_one_bf16_input_per_layer():
    """What each extra layer adds to the step's temporaries under remat=full: its
    bfloat16 input (rows x seq x dim x 2 bytes per device; the residual stream is
    not split over tensor by the default rules) and its float32 gradient (sharded
    like the layer's parameters). Bounded at 1.5x that, from the difference of two
    depths so that one layer's working set cancels out."""
    per_layer = (full_remat_temp(6) - full_remat_temp(2)) / 4
    rows, seq, dim, ffn = 8 // 4, 256, 128, 256
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2),
                                             model=dict(dim=dim, ffn_dim=ffn)))
    layer_params = sum(x.size for x in jax.tree.leaves(exp.param_shapes["layers"])) / 2
    expected = rows * seq * dim * 2 + layer_params * 4 / 8
    assert per_layer <= 1.5 * expected, (per_layer, expected)


@pytest.mark.parametrize("mesh, model", [
    (dict(fsdp=4, tensor=2), {}),
    (dict(fsdp=4, context=2), {}),
])
def test_full_remat_layouts_match_single_device(mesh, model):
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=dict(model, remat="full")))
    assert_same_training(exp, {})


@pytest.mark.parametrize("chunk", [16, 64])  # 4 chunks; 1 (on CPU the softmax is kept)
def test_chunked_loss_equals_full_logits(chunk):
    rng = np.random.default_rng(0)
    b, s, d, v = 2, 64, 16, 50
    x = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (b, s)), jnp.float32)

    def full(x, head):
        return jnp.sum(cross_entropy(jnp.einsum("bsd,dv->bsv", x, head), targets) * mask)

    def chunked(x, head):
        return loss_sums(x, head, targets, mask, chunk=chunk)[0]

    ref, ref_grads = jax.value_and_grad(full, argnums=(0, 1))(x, head)
    out, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(x, head)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5)


def loss_temp(seq_len: int, chunk: int, vocab: int = 128_256, dim: int = 64) -> int:
    """Temporaries of the loss and its gradients (hidden states and LM head) for one
    row, compiled ahead of time: the part of the step that scales with the vocabulary."""
    def f(x, head, targets, mask):
        return loss_sums(x, head, targets, mask, chunk)[0]

    args = (jax.ShapeDtypeStruct((1, seq_len, dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((dim, vocab), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((1, seq_len), jnp.float32))
    compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_loss_memory_grows_with_the_chunk_not_the_sequence():
    """At Llama 3's vocabulary, 4x the sequence adds far less than its float32
    logits (3 x 1024 x 128256 x 4 bytes = 1.5 GiB), while 2x the chunk adds at
    least one more chunk of float32 logits (256 x 128256 x 4 bytes)."""
    vocab, short, long_ = 128_256, loss_temp(1024, 256), loss_temp(4096, 256)
    assert long_ - short < 0.05 * (4096 - 1024) * vocab * 4, (short, long_)
    assert loss_temp(4096, 512) - long_ >= 256 * vocab * 4


def test_chunked_loss_on_a_layout_matches_single_device():
    # seq_len 32 in chunks of 8 (strided over context=2): same training as one device.
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=2, context=2, tensor=2),
                                             train=dict(loss_chunk=8)))
    assert_same_training(exp, {})


@pytest.mark.parametrize("mesh", [dict(fsdp=4, tensor=2), dict(fsdp=2, context=4)])
def test_grad_accum_gives_the_same_training(mesh):
    init = reference({})[0]  # the same initial parameters for every k
    runs = {}
    for k in (1, 2, 4):
        # eps 1e-4 (conftest: 1e-6): Adam divides by sqrt(v) + eps, so a rarely seen
        # token's near-zero embedding gradient turns reduction-order noise into
        # parameter noise up to lr / eps times larger; micro-batching reorders sums.
        exp = Experiment.from_config(tiny_config(mesh=mesh, train=dict(
            batch_size=16, grad_accum=k, eps=1e-4)))
        runs[k] = run_steps(exp, init)
    for k in (2, 4):
        np.testing.assert_allclose(runs[k][0], runs[1][0], rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4),
                     runs[k][1], runs[1][1])
    assert not np.allclose(runs[1][1]["embed"], init.params["embed"], atol=1e-3)


def test_grad_accum_holds_one_micro_batch_of_activations():
    def temp(k):
        return temp_bytes(Experiment.from_config(tiny_config(
            mesh=dict(fsdp=8), model=dict(dim=128, ffn_dim=512),
            train=dict(batch_size=32, seq_len=256, grad_accum=k))))
    assert temp(4) < 0.6 * temp(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grad_accum_sums_bf16_parameters_gradients_unrounded(dtype):
    """grad_accum=4 with bfloat16 parameters: the accumulated gradient is the float32 sum
    of the micro-batches' float32 gradients, i.e. what float32 parameters holding the same
    (bfloat16) values get: the same values reach the same matmuls, in ``dtype``.

    Each micro-batch's gradient used to be rounded to bfloat16 (the dtype of the
    parameter it is the gradient of) before the float32 sum: off by up to 2^-9 of
    itself, ~200x this test's tolerance (GRAD_RTOL of each parameter's largest, the
    layouts' summation-order noise; checked below to be far below bfloat16 rounding).
    The sum stays in the parameters' sharding (the step's accumulator).
    """
    mesh, train = dict(fsdp=4, tensor=2), dict(batch_size=16, grad_accum=4)
    bf16 = Experiment.from_config(tiny_config(
        mesh=mesh, model=dict(param_dtype="bfloat16", dtype=dtype), train=train))
    f32 = Experiment.from_config(tiny_config(
        mesh=mesh, model=dict(param_dtype="float32", dtype=dtype), train=train))
    init = jax.device_get(bf16.init_state())
    widened = init.replace(params=jax.tree.map(lambda p: np.asarray(p, np.float32), init.params))
    want = first_step_grads(f32, widened)

    params = jax.device_put(init.params, bf16.state_sharding.params)
    batch = bf16.device_batch(host_batches(bf16.config, 1)[0])
    fn = functools.partial(loss_and_grads, bf16.features, bf16.step_options,
                           grad_shardings=bf16.state_sharding.params)
    with rules_lib.use(bf16.rules):
        got = jax.jit(fn)(params, batch)[2]
    for (path, g), w, p in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                               jax.tree.leaves(bf16.state_sharding.params)):
        assert g.dtype == jnp.float32 and g.sharding.is_equivalent_to(p, g.ndim), path
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=GRAD_RTOL * np.abs(w).max(),
                                   err_msg=jax.tree_util.keystr(path))
    # Not vacuous: bfloat16 rounding of these gradients is far above the tolerance.
    rounded = max(np.abs(np.asarray(w, jnp.bfloat16).astype(np.float32) - w).max()
                  / np.abs(w).max() for w in jax.tree.leaves(want))
    assert rounded > 20 * GRAD_RTOL, rounded


def test_grad_accum_with_bf16_parameters_still_gathers_bf16():
    """The float32 gradients of bfloat16 parameters under grad_accum cost no wider
    all-gathers: computed in float32, the weights are still gathered in bfloat16 and
    widened after, and their gradients reduce-scattered in float32."""
    exp = Experiment.from_config(tiny_config(
        mesh=dict(fsdp=8), model=dict(param_dtype="bfloat16", dtype="float32"),
        train=dict(batch_size=16, grad_accum=2)))
    hlo = partitioned_hlo(exp.lower_step())
    assert collective_types(hlo, "all-gather") == {"bf16"}
    assert collective_types(hlo, "all-reduce") | collective_types(hlo, "reduce-scatter") \
        == {"f32"}
