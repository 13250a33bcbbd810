"""LoRA: fresh adapters leave the base model's logits exactly, only the adapters train
(the base bit for bit, no optimizer state for it, no weight gradients formed for it),
LoRA trains like one device on fsdp x tensor and fsdp x context, and its dropout drops
the adapters' inputs alone, with the same masks on every layout."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from helpers import assert_same_training, host_batches, run_steps

from ndjax.experiment import Experiment
from ndjax.models import lora
from ndjax.runtime.errors import ConfigError

# rank 4 on every projection; alpha 16 (scale 4), so that 3 steps move the logits.
LORA = {"lora": {"rank": 4, "alpha": 16.0}}
# The layout tests train with dropout: its masks must not depend on the layout.
DROPOUT = {"lora": {**LORA["lora"], "dropout": 0.25}}


def _inputs(config):
    batch = host_batches(config, 1)[0]
    return [jnp.asarray(batch[k]) for k in ("inputs", "positions", "segment_ids")]


def _same(a, b) -> bool:
    return all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                    strict=True))


def test_fresh_adapters_leave_the_base_models_logits_exactly():
    one = jax.devices()[:1]
    config = tiny_config(model=LORA)
    exp = Experiment.from_config(config, one)
    # Under LoRA the base is stored in bfloat16 (model.param_dtype=auto), the adapters
    # in float32.
    base = Experiment.from_config(tiny_config(model={"param_dtype": "bfloat16"}), one)
    params, base_params = (jax.device_get(e.init_state().params) for e in (exp, base))
    adapters, frozen = lora.split(params, True)
    assert _same(frozen, base_params)  # the base is drawn as without adapters
    assert {leaf.dtype for leaf in jax.tree.leaves(adapters)} == {np.dtype("float32")}
    assert set(adapters["layers"]["attn"]) == {"lora_q", "lora_k", "lora_v", "lora_o"}
    assert set(adapters["layers"]["mlp"]) == {"lora_gate", "lora_up", "lora_down"}
    # PEFT's init: B = 0 (so the update starts at 0), A uniform within 1 / sqrt(fan_in).
    q = adapters["layers"]["attn"]["lora_q"]
    assert not q["b"].any() and 0 < np.abs(q["a"]).max() <= 1 / np.sqrt(64)
    assert np.array_equal(exp.apply(params, *_inputs(config)),
                          base.apply(base_params, *_inputs(config)))


def test_only_the_adapters_train_and_hold_optimizer_state():
    exp = Experiment.from_config(tiny_config(model=LORA), jax.devices()[:1])
    init = jax.device_get(exp.init_state())
    adapters = lora.trainable(init.params, True)
    moments = jax.tree.leaves(exp.abstract_state.opt_state)
    # Adam's two moments of each adapter and nothing of the base (counts are scalars).
    assert sorted(m.size for m in moments if m.ndim) == sorted(
        2 * [a.size for a in jax.tree.leaves(adapters)])
    # What the start-up line and the FLOPs count as trained.
    assert lora.num_adapter_params(exp.model_cfg) == sum(a.size for a in jax.tree.leaves(adapters))
    _, params = run_steps(exp, init)
    moved, frozen = lora.split(params, True)
    assert _same(frozen, lora.split(init.params, True)[1])  # the base, bit for bit
    assert all(not np.array_equal(m, a) for m, a in zip(jax.tree.leaves(moved),
                                                        jax.tree.leaves(adapters)))
    # The step forms no weight gradient of the frozen base: about a third of a full
    # fine-tuning step's matmul FLOPs (x W's two backward matmuls, of which one remains).
    full = Experiment.from_config(tiny_config(model={"param_dtype": "bfloat16"}),
                                  jax.devices()[:1])
    ratio = (exp.compiled_step.cost_analysis()["flops"]
             / full.compiled_step.cost_analysis()["flops"])
    assert ratio < 0.85, ratio


@pytest.mark.parametrize("mesh", [dict(fsdp=4, tensor=2), dict(fsdp=4, context=2)],
                         ids=["fsdp4_tensor2", "fsdp4_context2"])
def test_lora_trains_like_one_device(cpu_devices, mesh):
    """With dropout: under context parallelism the sequence is permuted (ring attention's
    zigzag), and each token's mask must follow it."""
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=DROPOUT), cpu_devices)
    assert (exp.seq_permutation is not None) == ("context" in mesh)
    init, params = assert_same_training(exp, DROPOUT)
    assert _same(lora.split(params, True)[1], lora.split(init.params, True)[1])


def test_lora_with_grad_accum_and_full_remat_trains_like_without(cpu_devices):
    """Two micro-batches under full remat, with dropout: the losses of one batch without
    remat (rtol 1e-5), the base untouched."""
    def exp(k, remat):
        return Experiment.from_config(tiny_config(
            mesh=dict(fsdp=4, tensor=2), model={**DROPOUT, "remat": remat},
            train=dict(batch_size=16, grad_accum=k)), cpu_devices)

    one = exp(1, "none")
    init = jax.device_get(one.init_state())
    (want, _), (losses, params) = run_steps(one, init), run_steps(exp(2, "full"), init)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    adapters, frozen = lora.split(params, True)
    assert _same(frozen, lora.split(init.params, True)[1])
    assert not _same(adapters, lora.split(init.params, True)[0])  # it trained


def test_dropout_drops_the_adapters_input_alone():
    """PEFT's ``W x + scale * B A dropout(x)``: a fraction ``rate`` of the adapter's input
    zeroed, the rest scaled by 1 / (1 - rate), the base projection untouched; a mask of
    its own per target, layer and step, following the token wherever it sits."""
    rate, keep = 0.25, 0.75
    drop = lora.step_dropout(rate, seed=0, step=jnp.int32(3), batch=4, seq_len=64)
    x = jnp.ones((4, 64, 32))
    scaled = np.asarray(drop(x, "q"))
    assert set(np.unique(scaled)) == {0.0, np.float32(1 / keep)}
    dropped = (scaled == 0).mean()
    assert abs(dropped - rate) < 5 * np.sqrt(rate * keep / scaled.size), dropped  # 5 sigma
    masks = [drop(x, "q"), drop(x, "k"), drop.at_layer(1)(x, "q"),
             lora.step_dropout(rate, 0, jnp.int32(4), 4, 64)(x, "q")]
    assert all(not np.array_equal(masks[0], m) for m in masks[1:])
    # The mask is a function of the token's id: permute the ids, and the rows follow.
    order = np.random.default_rng(0).permutation(64)
    moved = dataclasses.replace(drop, token_ids=drop.token_ids[:, order])
    assert np.array_equal(np.asarray(moved(x, "q")), scaled[:, order])
    # Applied to the adapter's input only: the base projection sees x as it is.
    rng = np.random.default_rng(1)
    xs, w = rng.normal(size=(4, 64, 32)).astype(np.float32), rng.normal(size=(32, 16))
    adapter = lora.Adapter(nnx.Rngs(params=0), (32,), ("embed",), (16,), ("mlp",), 4)
    adapter.b[...] = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    base = jnp.einsum("bsd,df->bsf", xs, w)
    got = lora.adapted(base, adapter, "bsd,df->bsf", jnp.asarray(xs), 1, jnp.float32, 2.0,
                       dropout=drop, target="up")
    seen = xs * np.asarray(drop(jnp.ones_like(xs), "up"))
    want = base + 2.0 * (seen @ np.asarray(adapter.a[...])) @ np.asarray(adapter.b[...])
    # float32 sums of 32 and 4 terms of size ~1, in XLA's order against numpy's.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dropout_changes_training_but_not_evaluation(cpu_devices):
    """Dropout is the train step's: its losses move off those without it once B is no
    longer 0, while the evaluation of the same parameters is the same bit for bit."""
    with_, without = (Experiment.from_config(tiny_config(model=m), cpu_devices[:1])
                      for m in (DROPOUT, LORA))
    init = jax.device_get(without.init_state())
    (a, params), (b, _) = run_steps(with_, init), run_steps(without, init)
    assert a[0] == b[0] and abs(a[2] - b[2]) > 1e-5, (a, b)  # B = 0 at the first step
    batch = with_.device_batch(host_batches(with_.config, 1)[0])
    params = jax.device_put(params, with_.state_sharding.params)
    evals = [e.compiled_eval(params, batch)["loss"] for e in (with_, without)]
    assert evals[0] == evals[1]


def test_lora_on_an_experts_mlp_is_refused():
    config = tiny_config(model={"family": "qwen3_moe", **LORA})
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules='all-linear': "
                                          r"model.family='qwen3_moe' is a mixture of experts.*"
                                          r"target_modules='q_proj,k_proj,v_proj,o_proj'"):
        Experiment.from_config(config, jax.devices()[:1])
    config.model.lora.target_modules = "q_proj,o_proj"
    exp = Experiment.from_config(config, jax.devices()[:1])
    assert set(lora.trainable(exp.param_shapes, True)["layers"]["attn"]) == {"lora_q", "lora_o"}


def test_checkpoints_hold_the_adapters_and_resume_exactly_on_any_layout(tmp_path):
    """A LoRA checkpoint is the adapters and their optimizer state (the base is re-read
    from where step 0 had it: here the seed); resumed on the same layout the run goes on
    bit for bit, on another one within the layouts' tolerance."""
    from ndjax.runs.checkpoint import Checkpointer
    from ndjax.training.loop import train
    from ndjax.verbs.export import export_checkpoint

    def config(mesh, resume="auto"):
        c = tiny_config(mesh=mesh, model=LORA, train=dict(steps=6))
        c.checkpoint.every, c.checkpoint.resume, c.log.tensorboard = 3, resume, False
        return c

    saved_on = dict(fsdp=4, tensor=2)
    ref = config(saved_on)
    ref.export.adapter_dir, ref.export.hf_dir = str(tmp_path / "peft"), str(tmp_path / "hf")
    reference = {r["step"]: r["loss"] for r in train(ref, str(tmp_path / "ref"), verbose=False)}
    # The export verb writes from the last checkpoint what the run's end wrote.
    for adapters, out, file in ((True, "peft", "adapter_model.safetensors"),
                                (False, "hf", "model.safetensors")):
        export_checkpoint(str(tmp_path / "ref"), str(tmp_path / f"{out}_verb"), adapters=adapters)
        assert ((tmp_path / f"{out}_verb" / file).read_bytes()
                == (tmp_path / out / file).read_bytes())
    # ndjax generate --workdir: the base re-read, the trained adapters restored.
    import safetensors.numpy

    from ndjax.verbs import generate
    model = generate.load(workdir=str(tmp_path / "ref"))
    peft_a = safetensors.numpy.load_file(tmp_path / "peft" / "adapter_model.safetensors")[
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    a = np.asarray(model.params["layers"]["attn"]["lora_q"]["a"][1])
    assert a.any() and np.array_equal(a.reshape(peft_a.shape[::-1]).T, peft_a)
    assert len(model.generator(4)([[5, 6, 7]])[0]) == 4
    ckpt = Checkpointer(str(tmp_path / "ref"), config(saved_on).checkpoint, read_only=True)
    saved = ckpt.manager.item_metadata(3)["state"]
    ckpt.close()
    assert "embed" not in saved["params"] and "lora_q" in saved["params"]["layers"]["attn"]
    assert "wq" not in saved["params"]["layers"]["attn"]

    for mesh, exact in ((saved_on, True), (dict(fsdp=2, context=2, tensor=2), False)):
        workdir = tmp_path / f"resumed_{len(mesh)}"
        shutil.copytree(tmp_path / "ref" / "checkpoints" / "3", workdir / "checkpoints" / "3")
        records = train(config(mesh, resume="3"), str(workdir), verbose=False)
        assert [r["step"] for r in records] == [4, 5, 6]
        losses = [r["loss"] for r in records]
        if exact:
            assert losses == [reference[s] for s in (4, 5, 6)]
        else:
            np.testing.assert_allclose(losses, [reference[s] for s in (4, 5, 6)], rtol=1e-5)


def test_peft_export_loads_onto_the_transformers_base_and_the_merged_export_agrees(
        cpu_devices, tmp_path):
    """Adapters exported in PEFT's format and loaded with ``peft`` onto the transformers
    base give ndjax's logits; the merged export is base + scale B A and gives them too."""
    import peft
    import safetensors.numpy
    from test_hf import FSDP_TP, config_for, hf_logits, make_hf, ndjax_logits, tokens
    from transformers import AutoModelForCausalLM

    from ndjax.runs import hf

    base = make_hf(tmp_path / "base")
    config = config_for(tmp_path / "base", mesh=FSDP_TP)
    # A float32 base, to compare with transformers' float32 model at 1e-4.
    config.model.update(dict(param_dtype="float32", lora=dict(rank=4, alpha=16.0)))
    exp = Experiment.from_config(config, cpu_devices)
    params = jax.device_get(exp.init_state().params)
    # Adapters that change the logits by ~1 (fresh ones, B = 0, change nothing).
    rng = np.random.default_rng(0)
    flat = {p: (rng.normal(0, 0.2, a.shape).astype(a.dtype) if lora.is_adapter(p) else a)
            for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    params = jax.tree_util.tree_unflatten(jax.tree.structure(params), list(flat.values()))
    params = jax.device_put(params, exp.state_sharding.params)
    toks = tokens(256)
    ours = ndjax_logits(exp, params, toks)
    assert np.abs(ours - ndjax_logits(exp, lora.merge(
        lora.split(params, True)[1], jax.tree.map(np.zeros_like, lora.trainable(
            jax.device_get(params), True))), toks)).max() > 0.5  # the adapters matter

    hf.export_adapter(params, exp.model_cfg, str(tmp_path / "adapter"), base=str(tmp_path))
    with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(hf_logits(with_adapter, toks), ours, rtol=0, atol=1e-4)

    hf.export(params, exp.model_cfg, str(tmp_path / "merged"), "float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged, toks), ours, rtol=0, atol=1e-4)
    adapter = safetensors.numpy.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    name = "model.layers.1.self_attn.o_proj"
    a, b = (adapter[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
    w = safetensors.numpy.load_file(tmp_path / "base" / "model.safetensors")[f"{name}.weight"]
    got = safetensors.numpy.load_file(tmp_path / "merged" / "model.safetensors")[f"{name}.weight"]
    np.testing.assert_allclose(got, w + 16.0 / 4 * (b @ a), rtol=1e-6, atol=1e-6)


def test_trained_peft_adapters_start_a_run_and_export_back_bit_for_bit(cpu_devices, tmp_path):
    """model.lora.init_from: adapters trained with ``peft`` (targets in another order, B
    non-zero) give at step 0 the logits of the peft model, with fresh moments; exported
    again and read back, they are the same bits; without model.init_from they go on a
    base drawn from the seed."""
    import peft
    import safetensors.numpy
    import torch
    from test_hf import FSDP_TP, config_for, hf_logits, make_hf, ndjax_logits, tokens

    from ndjax.runs import hf

    model = peft.get_peft_model(make_hf(tmp_path / "base"), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["v_proj", "q_proj", "down_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():  # PEFT starts B at 0: trained adapters change the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.eval().save_pretrained(tmp_path / "peft")
    config = config_for(tmp_path / "base", mesh=FSDP_TP)
    lora_fields = dict(rank=4, alpha=16.0, target_modules="q_proj,v_proj,down_proj",
                       init_from=str(tmp_path / "peft"))
    config.model.update(dict(param_dtype="float32", lora=lora_fields))
    exp = Experiment.from_config(config, cpu_devices)
    state = exp.init_state()
    toks = tokens(256)
    with model.disable_adapter():
        base_logits = hf_logits(model, toks)
    assert np.abs(hf_logits(model, toks) - base_logits).max() > 0.5  # the adapters matter
    # The bound for ndjax against peft (float32, another summation order).
    np.testing.assert_allclose(ndjax_logits(exp, state.params, toks), hf_logits(model, toks),
                               rtol=0, atol=1e-4)
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(state.opt_state))

    adapters = jax.device_get(lora.trainable(state.params, True))
    hf.export_adapter(state.params, exp.model_cfg, str(tmp_path / "again"))
    assert _same(safetensors.numpy.load_file(tmp_path / "again" / "adapter_model.safetensors"),
                 safetensors.numpy.load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    shapes, shardings = (lora.trainable(t, True) for t in (exp.param_shapes,
                                                           exp.state_sharding.params))
    assert _same(hf.load_adapter(str(tmp_path / "again"), exp.model_cfg, shapes, shardings),
                 adapters)
    drawn = tiny_config(model=dict(n_kv_heads=2, lora={**lora_fields,
                                                       "init_from": str(tmp_path / "again")}))
    params = Experiment.from_config(drawn, cpu_devices[:1]).init_state().params
    assert _same(lora.trainable(params, True), adapters)


@pytest.mark.parametrize("edit, says", [
    (lambda c, d: c.model.lora.update(rank=8),
     "adapter_config.json has r=4, and model.lora.rank=8: set model.lora.rank=4."),
    (lambda c, d: (d / "adapter_model.safetensors").unlink(),
     "has no adapter_model.safetensors: point it at a directory written by PEFT's "),
], ids=["rank", "missing_file"])
def test_trained_adapters_that_do_not_fit_are_one_line_errors(tmp_path, edit, says):
    from ndjax.runs import hf

    one = jax.devices()[:1]
    exp = Experiment.from_config(tiny_config(model=LORA), one)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         lora.trainable(exp.param_shapes, True))
    hf.export_adapter(zeros, exp.model_cfg, str(tmp_path / "a"))
    config = tiny_config(model={"lora": {**LORA["lora"], "init_from": str(tmp_path / "a")}})
    edit(config, tmp_path / "a")
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(config, one)
    message = str(e.value)
    assert message.startswith(f"model.lora.init_from={str(tmp_path / 'a')!r}") and says in message
    assert "\n" not in message
