"""The model against plain references, on one device."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL
from flax import nnx

from ndjax.models import decoder, registry
from ndjax.models.layers import Rope, RopeScaling, rope_frequencies
from ndjax.ops import attention as attention_ops


@functools.cache
def make(**overrides):
    """(config, jitted forward) of a freshly initialised model."""
    cfg = decoder.DecoderConfig(**{**TINY_MODEL, **overrides})
    graphdef, params = nnx.split(decoder.Decoder(cfg, nnx.Rngs(params=jax.random.key(0))))
    forward = jax.jit(lambda p, *args: nnx.merge(graphdef, p)(*args))
    return cfg, lambda *args: forward(params, *args)


@functools.cache
def make_split(**overrides):
    cfg = decoder.DecoderConfig(**{**TINY_MODEL, **overrides})
    return nnx.split(decoder.Decoder(cfg, nnx.Rngs(params=jax.random.key(0))))


def inputs(b=2, s=24, vocab=256, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, s)).astype(np.int32)
    # Two packed documents per row: positions restart at the boundary.
    segment_ids = np.where(np.arange(s) < s // 3, 1, 2)[None].repeat(b, 0).astype(np.int32)
    positions = np.where(segment_ids == 1, np.arange(s), np.arange(s) - s // 3).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)


def naive_attention(q, k, v, seg):
    """Loop over batch and heads; explicit mask; float64."""
    q, k, v, seg = (np.asarray(a, np.float64) for a in (q, k, v, seg))
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            scores = q[bi, :, hi] @ k[bi, :, hi // group].T / math.sqrt(d)
            allowed = np.tril(np.ones((s, s), bool)) & (seg[bi][:, None] == seg[bi][None])
            scores = np.where(allowed, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[bi, :, hi] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, hi // group]
    return out


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (8, 1)])
def test_attention_matches_naive(heads, kv_heads):
    rng = np.random.default_rng(1)
    b, s, d = 2, 20, 8
    q = rng.normal(size=(b, s, heads, d)).astype(np.float32)
    k = rng.normal(size=(b, s, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(b, s, kv_heads, d)).astype(np.float32)
    seg = np.repeat(np.array([[1] * 7 + [2] * 9 + [3] * 4]), b, 0)
    out = attention_ops.dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                              jnp.asarray(seg))
    np.testing.assert_allclose(out, naive_attention(q, k, v, seg), atol=1e-5)


def test_llama3_rope_scaling_matches_formula():
    cfg = decoder.DecoderConfig(**{**TINY_MODEL, "rope_theta": 500_000.0},
                            rope_scaling=RopeScaling(factor=8.0))
    inv = 1.0 / 500_000.0 ** (np.arange(0, cfg.hd, 2) / cfg.hd)
    expected = []
    for f in inv:  # Meta's reference loop, one frequency at a time
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            expected.append(f)
        elif wavelen > 8192 / 1.0:
            expected.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(rope_frequencies(Rope(cfg.rope_theta, cfg.rope_scaling), cfg.hd),
                               expected, rtol=1e-6)


def test_documents_do_not_see_each_other():
    _, model = make()
    tokens, positions, seg = inputs()
    logits = model(tokens, positions, seg)
    # Change every token of document 1: document 2's logits must not move.
    other = jnp.where(seg == 1, (tokens + 7) % 256, tokens)
    logits2 = model(other, positions, seg)
    np.testing.assert_array_equal(logits[seg == 2], logits2[seg == 2])
    assert not np.allclose(logits[seg == 1], logits2[seg == 1])


def test_position_restart_makes_documents_independent_of_offset():
    # A document gives the same logits at the start of a row or packed after another.
    _, model = make()
    tokens, positions, seg = inputs(b=1, s=24)
    n = 24 // 3
    alone = model(tokens[:, n:], positions[:, n:], seg[:, n:])
    packed = model(tokens, positions, seg)
    np.testing.assert_allclose(packed[:, n:], alone, atol=1e-5)


def test_scan_and_unrolled_agree():
    _, scanned = make(scan_layers=True)
    _, unrolled = make(scan_layers=False)
    args = inputs()
    np.testing.assert_allclose(scanned(*args), unrolled(*args), atol=1e-5)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("model", ["gemma_pattern", "moe"])
def test_the_layer_stack_cut_into_stages_runs_as_the_whole(model, scan_layers):
    # What a pipeline stage runs (Decoder.layer_stack over its contiguous layers): the
    # stages in turn give the whole stack's stream, and their routers' statistics add up
    # to the whole's. Cuts inside and across a period of local and global layers (3 in
    # 7), and a MoE stack whose statistics are per layer.
    overrides = (dict(n_layers=7, sliding_window=5, sliding_window_pattern=3)
                 if model == "gemma_pattern" else dict(n_layers=4, n_experts=4,
                                                       experts_per_token=2))
    graphdef, params = make_split(scan_layers=scan_layers, **overrides)
    tokens, positions, seg = inputs()
    n = overrides["n_layers"]

    @functools.partial(jax.jit, static_argnums=1)
    def staged(params, cuts):
        net = nnx.merge(graphdef, params)
        x, _ = net.embed_tokens(tokens)
        tables, total = net.rope_tables(positions), {}
        for start, stop in zip(cuts[:-1], cuts[1:]):
            x, stats = net.layer_stack(x, tables, seg, start=start, stop=stop)
            total = jax.tree.map(jnp.add, total, stats) if total else stats
        return x, total

    whole = staged(params, (0, n))
    # float32; a cut changes how XLA fuses across the scan's boundary, not the math.
    for cuts in [(0, 1, n), (0, 2, 5, n) if n > 5 else (0, 2, 3, n), (0, n - 1, n)]:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                     staged(params, cuts), whole)
    if model == "moe":
        assert whole[1], "the MoE stack's statistics"


@functools.cache
def loss_and_grads(remat, **overrides):
    graphdef, params = make_split(remat=remat, **overrides)
    tokens, positions, seg = inputs()

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens, positions, seg)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", ["full", "save_proj", "save_attn", "offload"])
def test_remat_policies_give_identical_loss_and_grads(remat):
    ref_loss, ref_grads = loss_and_grads("none")
    # offload runs the layer scan (its inputs are what goes to the host); on a CPU the
    # host is the device's memory, so it must equal full to the bit.
    loss, grads = loss_and_grads(remat, **({"scan_layers": True} if remat == "offload" else {}))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, ref_grads)
    if remat == "offload":
        full = loss_and_grads("full", scan_layers=True)
        jax.tree.map(np.testing.assert_array_equal, (loss, grads), full)


def test_offload_needs_the_layer_scan():
    with pytest.raises(ValueError, match="offload.*needs scan_layers"):
        make_split(remat="offload", scan_layers=False)


def test_remat_full_saves_less_than_none():
    def temp_bytes(remat):
        graphdef, params = make_split(remat=remat)
        tokens, positions, seg = inputs(b=4, s=64)

        def loss(p):
            return jnp.sum(nnx.merge(graphdef, p)(tokens, positions, seg))

        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") < temp_bytes("none")


def test_tied_embeddings_have_no_lm_head():
    cfg, model = make(tie_embeddings=True)
    params = nnx.to_pure_dict(make_split(tie_embeddings=True)[1])
    assert "lm_head" not in params
    assert sum(x.size for x in jax.tree.leaves(params)) == decoder.num_params(cfg)
    assert model(*inputs()).shape == (2, 24, 256)


def test_param_count_formula_matches_the_model():
    cfg, _ = make()
    params = nnx.to_pure_dict(make_split()[1])
    assert sum(x.size for x in jax.tree.leaves(params)) == decoder.num_params(cfg)


@pytest.mark.parametrize("preset, published", [
    ("llama3_1b", 1_235_814_400),     # Llama 3.2 1B
    ("llama3_8b", 8_030_261_248),     # Llama 3.1 8B
    ("llama3_70b", 70_553_706_496),   # Llama 3.1 70B
    ("llama3_405b", 405_853_388_800),  # Llama 3.1 405B
])
def test_presets_have_the_published_sizes(preset, published):
    assert decoder.num_params(registry.config_from_preset("llama", preset)) == published


def test_tiny_preset_is_about_ten_million():
    assert 5e6 < decoder.num_params(registry.config_from_preset("llama", "tiny")) < 15e6


def test_bfloat16_compute_stays_close_to_float32():
    # bf16 keeps 8 mantissa bits (~0.4% per rounding); over 2 layers the
    # logits (magnitude ~1) move by a few 1e-2 at most.
    _, f32 = make()
    _, bf16 = make(dtype=jnp.bfloat16)
    args = inputs()
    diff = np.abs(np.asarray(f32(*args)) - np.asarray(bf16(*args)))
    assert diff.max() < 5e-2
    assert diff.max() > 0  # it really ran in bf16
