"""The mixture-of-experts MLP (ndjax.models.moe): dropless dispatch against a per-token
reference, every token on one expert, the load-balancing loss in the training loss,
the refused configurations, and the active parameters in the FLOPs. The families
against transformers (logits, the load-balancing loss, HF import and export, layouts)
are in tests/test_families.py."""

import collections
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from helpers import assert_same_training, host_batches

from ndjax.experiment import Experiment
from ndjax.models import decoder, moe, registry
from ndjax.parallel import rules as rules_lib
from ndjax.parallel.mesh import AXES
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.step.train_step import loss_aux_and_grads

MOE = dict(family="qwen3_moe", head_dim=16, n_experts=4, experts_per_token=2, moe_ffn_dim=32)


def naive(x, experts, weights, w_gate, w_up, w_down):
    """Each token alone: the sum over its k experts of weight x SwiGLU(x)."""
    out = np.zeros(x.shape, np.float64)
    for t in np.ndindex(x.shape[:-1]):
        for e, w in zip(experts[t], weights[t]):
            h = x[t] @ w_gate[e]
            h = h / (1 + np.exp(-h)) * (x[t] @ w_up[e])
            out[t] += w * (h @ w_down[e])
    return out


def random_weights(rng, e, d, f):
    return [rng.normal(0, 0.3, s).astype(np.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]


def test_dispatch_computes_every_token_as_alone():
    """Random routing with uneven groups (one expert gets no token): every (token,
    expert) pair is computed, none dropped, each as the token alone would be."""
    rng = np.random.default_rng(0)
    b, s, d, f, e, k = 2, 12, 8, 16, 5, 2
    x = rng.normal(size=(b, s, d)).astype(np.float32)
    # Experts 0-3 only (4 gets none), two distinct per token.
    experts = np.stack([rng.permutation(4)[:k] for _ in range(b * s)]).reshape(b, s, k)
    weights = rng.uniform(0.1, 1.0, (b, s, k)).astype(np.float32)
    ws = random_weights(rng, e, d, f)
    got = jax.jit(moe.dispatch)(x, experts.astype(np.int32), weights, *ws)
    np.testing.assert_allclose(got, naive(x, experts, weights, *ws), rtol=1e-5, atol=1e-5)


def make_moe(**overrides):
    cfg = decoder.DecoderConfig(**{**registry.preset_dims(registry.get("qwen3_moe"), "tiny"),
                                   "dim": 32, "moe_ffn_dim": 16, **overrides})
    return cfg, moe.MoE(cfg, nnx.Rngs(params=0))


def mesh_of(**sizes):
    shape = tuple(sizes.get(a, 1) for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def _all_tokens_to_expert_2(mesh, **overrides):
    """A top-1 MoE whose router sends every token of an (8, 16) batch to expert 2
    (logits +sum(x) for it, -sum(x) for the others), run on ``mesh`` (None: one
    device): (cfg, x, output, statistics, expert 2's SwiGLU of every token)."""
    cfg, layer = make_moe(experts_per_token=1, norm_topk_prob=True, **overrides)
    x = np.abs(np.random.default_rng(1).normal(size=(8, 16, cfg.dim))).astype(np.float32)
    router = np.full((cfg.dim, cfg.n_experts), -1.0, np.float32)
    router[:, 2] = 1.0
    layer.router[...] = jnp.asarray(router)
    graphdef, params = nnx.split(layer)

    def run(params, x):
        return nnx.merge(graphdef, params)(x)
    if mesh is None:
        out, stats = jax.jit(run)(params, x)
    else:
        with rules_lib.use(rules_lib.Rules("default", mesh_of(**mesh))):
            out, stats = jax.jit(run)(params, x)
    w = [np.asarray(v[...])[2] for v in (layer.w_gate, layer.w_up, layer.w_down)]
    h = x @ w[0]
    return cfg, x, out, stats, (h / (1 + np.exp(-h)) * (x @ w[1])) @ w[2]


@pytest.mark.parametrize("mesh", [None, dict(fsdp=4, tensor=2), dict(fsdp=2, expert=4)],
                         ids=["one_device", "fsdp_tp", "fsdp_expert"])
def test_all_tokens_on_one_expert_equal_its_dense_mlp(mesh):
    """A router that sends every token to expert 2 (top-1, renormalised: weight 1): the
    MoE's output is expert 2's SwiGLU on every token, and its statistics count them all
    there. Under fsdp x tensor each device's tokens form one group of its own; under
    expert=4 every device's tokens travel to the one that holds experts 2 and 3, which
    receives the worst case its buffer is sized for, and no token is lost."""
    cfg, x, out, stats, want = _all_tokens_to_expert_2(mesh)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats["assigned"], [0, 0, x.shape[0] * x.shape[1], 0, 0, 0,
                                                      0, 0])


def test_within_capacity_keeps_each_rows_first_pairs_per_expert():
    rng = np.random.default_rng(4)
    experts = rng.integers(0, 5, size=(3, 10, 2))
    got = np.asarray(moe.within_capacity(jnp.asarray(experts, jnp.int32), 5, 3))
    want = np.zeros_like(got)
    for r in range(3):
        seen = collections.Counter()
        for t in range(10):
            for j in range(2):
                want[r, t, j] = seen[experts[r, t, j]] < 3
                seen[experts[r, t, j]] += 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh", [None, dict(fsdp=4, tensor=2), dict(fsdp=2, expert=4)],
                         ids=["one_device", "fsdp_tp", "fsdp_expert"])
def test_capacity_mode_drops_exactly_the_overflow_it_reports(mesh):
    """Every token to expert 2 (top-1) with capacity_factor 2 over 8 experts: each row's
    first ceil(2 x 16 / 8) = 4 tokens get expert 2's SwiGLU, the other 12 are dropped
    (zeros), and the step reports 12 / 16 of the pairs dropped. Under expert=4 the
    device holding expert 2 receives every device's first 4 tokens per row, within the
    buffer capacity mode sizes (half of dropless's here)."""
    cfg, x, out, stats, want = _all_tokens_to_expert_2(mesh, capacity_factor=2.0)
    assert moe.capacity(cfg, 16) == 4
    want[:, 4:] = 0.0
    # float32 against numpy's float32 reference, the tolerance of the dropless case above.
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    metrics = moe.aux_metrics(stats, cfg.n_experts, cfg.experts_per_token)
    assert float(stats["dropped"]) == 8 * 12
    assert float(metrics["expert_dropped"]) == 12 / 16


def test_a_capacity_no_row_fills_equals_dropless():
    cfg, layer = make_moe()
    roomy = dataclasses.replace(cfg, capacity_factor=float(cfg.n_experts))  # C = seq x k
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, cfg.dim)), jnp.float32)
    out, stats = layer(x)
    layer.cfg = roomy
    out2, stats2 = layer(x)
    np.testing.assert_array_equal(out, out2)
    assert float(stats2["dropped"]) == 0


def test_routing_renormalises_as_the_family_says():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    probs = jax.nn.softmax(logits)
    experts, weights = moe.route(probs, 2, renormalise=False)
    np.testing.assert_array_equal(experts, [[0, 1]])
    np.testing.assert_allclose(weights, probs[:, :2], rtol=1e-6)
    _, renormed = moe.route(probs, 2, renormalise=True)
    # Softmax over the top-k logits (Mixtral's form).
    np.testing.assert_allclose(renormed, jax.nn.softmax(logits[:, :2]), rtol=1e-6)


def _gradient_with_and_without(field, option, coef, metric):
    """One step's (loss, aux, gradients) with model.<field> = coef and with the step's
    ``option`` at 0, and the gradient of ``metric`` alone."""
    exp = Experiment.from_config(tiny_config(model={**MOE, field: coef}), jax.devices()[:1])
    assert getattr(exp.step_options, option) == coef
    params = exp.init_state().params
    batch = exp.device_batch(host_batches(exp.config, 1)[0])
    step = jax.jit(functools.partial(loss_aux_and_grads, exp.features, exp.step_options))
    without = jax.jit(functools.partial(
        loss_aux_and_grads, exp.features, dataclasses.replace(exp.step_options,
                                                              **{option: 0.0})))

    def alone(p):
        return exp.features(p, batch["inputs"], batch["positions"],
                            batch["segment_ids"])[2][metric]
    with rules_lib.use(exp.rules):
        loss, _, grads, aux = step(params, batch)
        loss0, _, grads0, _ = without(params, batch)
        metric_grads = jax.jit(jax.grad(alone))(params)
    return exp, loss, loss0, aux, grads, grads0, metric_grads


def test_load_balancing_loss_is_in_the_training_loss():
    """The step's gradient is the cross-entropy's plus router_aux_loss_coef x the
    load-balancing loss's, and its metrics carry aux_loss and the experts' loads."""
    coef = 0.5
    exp, loss, loss0, aux, grads, grads0, aux_grads = _gradient_with_and_without(
        "router_aux_loss_coef", "aux_loss_coef", coef, "aux_loss")
    assert float(loss) == float(loss0)  # the logged loss is the cross-entropy
    # Balanced routing gives k; a random router is near it.
    assert 1.5 < float(aux["aux_loss"]) < 3.0
    assert float(aux["expert_load_min"]) <= 1.0 <= float(aux["expert_load_max"])
    router = ("layers", "mlp", "router")
    got = np.asarray(grads["layers"]["mlp"]["router"]) - np.asarray(grads0["layers"]["mlp"]
                                                                     ["router"])
    want = coef * np.asarray(aux_grads["layers"]["mlp"]["router"])
    assert np.abs(want).max() > 1e-4, router
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # It reaches nothing after the last router: the last layer's experts, the head.
    for got, want in ((grads["layers"]["mlp"]["w_gate"][-1],
                       grads0["layers"]["mlp"]["w_gate"][-1]),
                      (grads["lm_head"], grads0["lm_head"])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert not np.allclose(grads["layers"]["mlp"]["w_gate"][0],
                           grads0["layers"]["mlp"]["w_gate"][0], rtol=1e-3, atol=0)
    from ndjax.step.train_step import train_step
    step = functools.partial(train_step, exp.features, exp.optimizer, exp.schedule,
                             exp.step_options, None)
    with rules_lib.use(exp.rules):
        _, metrics = jax.eval_shape(step, exp.abstract_state, exp.abstract_batch)
    assert {"aux_loss", "router_z_loss", "expert_dropped", "expert_load_min",
            "expert_load_max"} <= set(metrics)


def test_router_z_loss_is_the_mean_squared_logsumexp_and_in_the_training_loss():
    """router_z_loss: the squared logsumexp of each real token's router logits, averaged
    (ST-MoE), padding left out; the step's gradient is the cross-entropy's plus
    router_z_loss_coef x the z-loss's, and the logged loss stays the cross-entropy."""
    cfg, block = make_moe()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 8, cfg.dim)).astype(np.float32)
    real = np.ones((2, 8), np.float32)
    real[1, 5:] = 0  # a row's padding
    _, stats = block(jnp.asarray(x), jnp.asarray(real))
    z = moe.aux_metrics(stats, cfg.n_experts, cfg.experts_per_token)["router_z_loss"]
    logits = x.astype(np.float64) @ np.asarray(block.router[...], np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    # float32 logits against a float64 reference: the f32 tolerance of the project.
    np.testing.assert_allclose(float(z), (lse ** 2 * real).sum() / real.sum(), rtol=1e-5)

    coef = 0.25
    _, loss, loss0, aux, grads, grads0, z_grads = _gradient_with_and_without(
        "router_z_loss_coef", "z_loss_coef", coef, "router_z_loss")
    assert float(loss) == float(loss0) and float(aux["router_z_loss"]) > 0
    got = np.asarray(grads["layers"]["mlp"]["router"]) - np.asarray(
        grads0["layers"]["mlp"]["router"])
    want = coef * np.asarray(z_grads["layers"]["mlp"]["router"])
    assert np.abs(want).max() > 1e-6
    # A difference of two float32 gradients (with and without the term) against the
    # term's own: cancellation leaves ~1e-4 of the term's largest entry, as for the
    # load-balancing loss above.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_bf16_experts_gather_bf16_and_reduce_f32():
    """Under FSDP the expert weights are gathered in bfloat16 and their gradients leave
    each device's tokens unsummed, to be reduce-scattered in float32 as the dense
    weights' are (not all-reduced in bfloat16 inside the dispatch's shard_map)."""
    from helpers import partitioned_hlo
    from test_memory_precision import collective_types
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=8),
                                             model=dict(MOE, dtype="bfloat16")))
    hlo = partitioned_hlo(exp.lower_step())
    # Every weight in bfloat16 but the router, which routes in float32 (dim x experts).
    gathered = set(re.findall(r"= (\w+\[[\d,]*\])[^ ]* all-gather\(", hlo))
    assert {g for g in gathered if not g.startswith("bf16")} == {"f32[64,4]"}
    assert {"bf16[4,64,32]", "bf16[4,32,64]"} <= gathered  # the experts' gate/up, down
    # On CPU a reduce-scatter is written as all-reduce + dynamic-slice.
    assert collective_types(hlo, "all-reduce") | collective_types(hlo, "reduce-scatter") \
        == {"f32"}


@pytest.mark.parametrize("mesh", [dict(fsdp=2, expert=4), dict(fsdp=4, tensor=2)],
                         ids=["expert", "tensor"])
def test_bf16_moe_compiles_and_trains_on_cpus(mesh):
    """Two XLA:CPU aborts that killed the process compiling a bfloat16 MoE step:
    expert: the CPU stand-in for the ragged all-to-all gathers in float32, since the
    bfloat16 reduce-scatter that is a bfloat16 all-gather's transpose aborted.
    tensor: the tokens' gradient summed by a bfloat16 psum inside the dispatch's
    shard_map aborted all-reduce-promotion; the partitioner sums it outside now.
    Each gives one device's first loss within bfloat16's rounding (its 8 mantissa
    bits: 2**-7 relative)."""
    from helpers import run_steps
    model = dict(MOE, dtype="bfloat16")
    one = Experiment.from_config(tiny_config(model=model), jax.devices()[:1])
    state = jax.device_get(one.init_state())
    ep = Experiment.from_config(tiny_config(mesh=mesh, model=model))
    (want, *_), _ = run_steps(one, state, steps=1)
    (got, *_), _ = run_steps(ep, state, steps=1)
    assert np.isfinite(got) and abs(got - want) <= 2 ** -7 * abs(want)


@pytest.mark.parametrize("model, says", [
    (dict(MOE, experts_per_token=5),
     "model.experts_per_token=5: each token runs through between 1 and model.n_experts=4"),
    (dict(family="llama", n_experts=8),
     "model.n_experts=8: model.family='llama' has no experts (it is dense)"),
    (dict(family="mixtral", n_experts=0),
     "model.n_experts=0: model.family='mixtral' is a mixture of experts"),
    (dict(family="mixtral", norm_topk_prob=False),
     "model.norm_topk_prob=False: model.family='mixtral' has no choice of renormalising"),
    (dict(family="mixtral", moe_ffn_dim=64),
     "model.moe_ffn_dim=64: model.family='mixtral' has no expert width of its own"),
])
def test_a_bad_moe_config_is_refused_in_one_line(model, says):
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(tiny_config(model=model), jax.devices()[:1])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.parametrize("mesh, model, says", [
    (dict(fsdp=2, expert=4), dict(family="llama"),
     "mesh.expert=4: model.family='llama' is dense (it has no experts to split)"),
    (dict(fsdp=1, expert=8), MOE,
     "mesh.expert=8 does not divide model.n_experts=4: each device holds n_experts / 8 "
     "experts. Use a divisor of 4, e.g. mesh.expert=4."),
    (dict(fsdp=1, expert=0), MOE, "mesh.expert=0 must be >= 1"),
    (dict(fsdp=8), dict(MOE, capacity_factor=0.0), "model.capacity_factor=0.0 must be a "
     "number > 0"),
    (dict(fsdp=8), dict(family="llama", capacity_factor=1.25),
     "model.capacity_factor=1.25: model.family='llama' is dense (it has no experts)"),
    (dict(fsdp=4, context=2), dict(MOE, capacity_factor=1.25),
     "model.capacity_factor=1.25: capacity mode ranks each row's tokens per expert, and "
     "the rules split the sequence over ['context']"),
])
def test_a_bad_expert_axis_is_refused_in_one_line(mesh, model, says):
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(tiny_config(mesh=mesh, model=model))
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.parametrize("variant", [dict(remat="full"), dict(remat="offload"),
                                     dict(scan_layers=False)])
def test_moe_trains_alike_however_its_layers_run(variant):
    """Full remat (each layer recomputed alone, the router statistics carried through
    its own scan), offload and unrolled layers give the scanned run's losses, the
    load-balancing loss among them, and first-step gradients."""
    model = dict(MOE, router_aux_loss_coef=0.1, remat="none")
    exp = Experiment.from_config(tiny_config(model={**model, **variant}), jax.devices()[:1])
    assert_same_training(exp, model)


def _ragged_dots(remat):
    """The grouped matmuls in the traced train step of a 2-layer MoE, unrolled."""
    from jax.extend import core as jcore  # (jax._src.core lost ClosedJaxpr in jax 0.12)

    from ndjax.step.train_step import train_step
    exp = Experiment.from_config(tiny_config(model=dict(MOE, scan_layers=False, remat=remat)),
                                 jax.devices()[:1])
    step = functools.partial(train_step, exp.features, exp.optimizer, exp.schedule,
                             exp.step_options, None)
    with rules_lib.use(exp.rules):
        jaxpr = jax.make_jaxpr(step)(exp.abstract_state, exp.abstract_batch).jaxpr

    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name.startswith("ragged_dot")
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                        n += count(sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub)
        return n
    return count(jaxpr)


def test_remat_policies_rerun_the_experts_as_the_dense_mlp():
    """Per layer, forward 3 grouped matmuls (gate, up, down) and backward 6 (each one's
    input and weight gradients); none and save_proj keep what the backward pass reads
    (mlp_gate, mlp_up, moe_out), so they rerun none of them; full reruns all 3."""
    layers = 2
    assert _ragged_dots("none") == _ragged_dots("save_proj") == 9 * layers
    assert _ragged_dots("save_attn") == _ragged_dots("full") == 12 * layers


def test_remat_prices_the_rerun_experts():
    """The roofline prices what those policies rerun: k experts' gate, up and down and
    the router under save_attn and full, nothing of the MLP under none and save_proj."""
    from ndjax.hardware import roofline
    cfg = registry.config_from_preset("qwen3_moe", "tiny")
    active = 2 * cfg.dim * cfg.experts_per_token * cfg.expert_dim * cfg.n_layers
    for remat in ("save_attn", "full"):
        rerun = roofline.recomputed_forward_flops(cfg, 128, remat)
        assert rerun["gate"] == rerun["up"] == rerun["expert_down"] == active
        assert rerun["router"] == 2 * cfg.dim * cfg.n_experts * cfg.n_layers
    for remat in ("none", "save_proj"):
        assert not {"gate", "up", "expert_down", "router"} & set(
            roofline.recomputed_forward_flops(cfg, 128, remat))


@pytest.mark.parametrize("model, says", [
    (dict(MOE, moe_ffn_dim=33), "model.moe_ffn_dim=33 (parameter layers/mlp/w_"),
    (dict(family="mixtral", ffn_dim=129), "model.ffn_dim=129 (parameter layers/mlp/w_"),
    (dict(MOE, family="qwen2_moe", head_dim=None, shared_expert_dim=49),
     "model.shared_expert_dim=49 (parameter layers/mlp/shared/w_"),
])
def test_an_expert_width_tensor_cannot_split_names_its_field(model, says):
    config = tiny_config(mesh=dict(fsdp=4, tensor=2), model=model)
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(config)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_experts_per_token_below_one_is_refused():
    config = tiny_config(model=dict(MOE, experts_per_token=0))
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(config, jax.devices()[:1])
    assert "model.experts_per_token" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key, value", [("decoder_sparse_step", 2), ("mlp_only_layers", [1])])
def test_dense_layers_among_qwen3_moe_ones_are_refused(tmp_path, key, value):
    config = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 128,
              key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        hf.open_checkpoint(str(tmp_path))
    assert f"{key}=" in str(e.value) and "every layer" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_param_count_formula_matches_the_model(family):
    cfg = registry.config_from_preset(family, "tiny")
    model = nnx.eval_shape(lambda: decoder.Decoder(cfg, nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sum(x.size for x in jax.tree.leaves(params)) == decoder.num_params(cfg)


@pytest.mark.parametrize("family, preset, total, active", [
    ("mixtral", "mixtral_8x7b", 46_702_792_704, 12.9e9),   # "46.7B, 12.9B active"
    ("qwen3_moe", "qwen3_30b_a3b", 30_532_122_624, 3.3e9),  # "30.5B, 3.3B activated"
    ("qwen3_moe", "qwen3_235b_a22b", 235_093_634_560, 22e9),  # "235B, 22B activated"
    # Rounded on the model cards: "14.3B" and "2.7B activated"; "57B", "14B activated"
    # (the Hub's count: 57.4B).
    ("qwen2_moe", "qwen1_5_moe_a2_7b", 14.3e9, 2.7e9),
    ("qwen2_moe", "qwen2_57b_a14b", 57.4e9, 14e9),
])
def test_presets_have_the_published_sizes(family, preset, total, active):
    cfg = registry.config_from_preset(family, preset)
    if isinstance(total, int):
        assert decoder.num_params(cfg) == total
    else:  # published to 0.1B: rounds to it
        assert round(decoder.num_params(cfg) / 1e8) == round(total / 1e8)
    assert abs(decoder.num_params(cfg, active=True) - active) < 0.05 * active


def test_flops_count_the_active_experts_and_the_router():
    """An MoE layer's FLOPs are a dense MLP's of k experts' width, plus the router."""
    cfg = registry.config_from_preset("qwen3_moe", "tiny")
    k, f = cfg.experts_per_token, cfg.expert_dim
    dense = dataclasses.replace(cfg, n_experts=0, experts_per_token=0, moe_ffn_dim=0,
                                ffn_dim=k * f)
    router = 6.0 * cfg.n_layers * cfg.dim * cfg.n_experts
    assert (registry.of(cfg).flops_per_token(cfg, 128)
            == decoder.train_flops_per_token(dense, 128) + router)


@pytest.mark.parametrize("site, impl, says", [
    (dict(platform="cpu"), "auto", "xla"),
    (dict(), "auto", "mosaic"),
    (dict(compute_capability="8.0"), "auto", "xla"),
    (dict(dtype="float32"), "auto", "xla"),
    (dict(platform="cpu"), "mosaic",
     "model.moe_impl='mosaic': jax's Mosaic GPU grouped matmuls run on NVIDIA Hopper GPUs, "
     "and this step is built for CPUs"),
    (dict(compute_capability="8.0"), "mosaic", "are written for Hopper GPUs"),
    (dict(dtype="float32"), "mosaic", "they need bfloat16 or float16 compute"),
    (dict(dims=(2048, 96)), "mosaic", "(model dim, width: 2048, 96) are not both multiples"),
    (dict(), "fast", "model.moe_impl='fast': choose one of ('auto', 'xla', 'mosaic')"),
])
def test_the_grouped_matmuls_are_chosen_by_gpu_dtype_and_shape(site, impl, says):
    """auto: the Mosaic GPU kernels on Hopper GPUs in bfloat16 with dims in whole
    blocks, ragged_dot elsewhere; an explicit mosaic that cannot run is one line."""
    from ndjax.ops import grouped_matmul as gm
    site = gm.Site(**{**dict(platform="gpu", compute_capability="9.0", dtype="bfloat16",
                             dims=(2048, 768)), **site})
    if impl == "auto":
        assert gm.choose(impl, site) == says
        return
    with pytest.raises(ConfigError) as e:
        gm.choose(impl, site)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_experiment_resolves_the_grouped_matmuls_up_front():
    exp = Experiment.from_config(tiny_config(model=MOE), jax.devices()[:1])
    assert exp.model_cfg.moe_impl == "xla"  # auto, on CPUs
    with pytest.raises(ConfigError, match=r"^model.moe_impl='mosaic': .* built for CPUs"):
        Experiment.from_config(tiny_config(model=dict(MOE, moe_impl="mosaic")),
                               jax.devices()[:1])
