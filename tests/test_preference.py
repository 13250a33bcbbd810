"""Preference objectives (train.objective dpo, ipo, orpo, simpo) against TRL 1.16, float32.

Checked, on a random tiny Llama and the same preference records (strings, and
ChatML conversations), TRL's own trainers computing their own loss (``compute_loss``
on their collated batch, their reference model):
- the first step's loss, TRL's logged metrics and every parameter's gradient (rtol 1e-5
  of the largest gradient of that parameter);
- 5 steps of AdamW (the same settings, torch's AdamW for TRL): losses within 1e-4
  (rtol), metrics within 1e-4 (rtol and atol);
- DPO's reference held as a frozen copy (full fine-tuning), and under LoRA both the
  adapters-off base and the adapters a run started from (TRL's "ref" adapter);
- fsdp x tensor and grad_accum give one device's first step.
``token_log_probs`` (the chunked LM head's per-token log-probabilities) is checked against
autodiff of a dense log-softmax, one device and fsdp x tensor.
Not checked here: the records' tokenization (tests/test_data_preference.py) and ORPO's and
SimPO's logits/* metrics, which TRL averages over padded logits (ndjax's are DPO's
token-weighted ones: docs/post-training.md).
"""

import contextlib
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import trl
from conftest import tiny_config
from data_files import texts, write_tokenizer
from test_hf import make_hf

from ndjax.data.loader import open_loader
from ndjax.experiment import Experiment
from ndjax.models import lora
from ndjax.ops.cross_entropy import token_log_probs
from ndjax.parallel import rules as rules_lib
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.step.train_step import loss_aux_and_grads, reference_features

EOS = "<|endoftext|>"
PROMPTS = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota", "kappa lambda"]
CHOSEN = [" delta epsilon", " zeta eta theta", " kappa", " mu nu xi omicron"]
REJECTED = [" omega", " pi rho sigma tau", " upsilon phi", " chi"]
# Adam's eps as tests/conftest.py's: it bounds how much Adam amplifies a gradient's
# float32 rounding (torch's and XLA's sum in different orders).
LR, STEPS, EPS = 1e-3, 5, 1e-6


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random Llama (vocabulary = its tokenizer's 300 ids), its tokenizer, and the
    preference records as JSON Lines: four pairs, every completion ending in EOS, so
    that TRL's DPO (which appends it) and ORPO/CPO (which add its id) agree."""
    folder = tmp_path_factory.mktemp("pref")
    path = write_tokenizer(folder / "tokenizer.json", texts(24))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": "<pad>"}))
    make_hf(folder, vocab_size=300)
    records = [{"prompt": p, "chosen": c + EOS, "rejected": r + EOS}
               for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)]
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder, path, data, records


def config(source, objective, mesh=None, **preference):
    folder, path, data, records = source
    c = tiny_config(mesh=mesh)
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "rope_theta"):
        c.model[field] = None
    c.model.init_from = str(folder)
    c.data.source, c.data.files, c.data.tokenizer = "chat", str(data), str(path)
    c.data.format = "preference"
    c.data.packing = False  # one pair a row: the 4 pairs are every step's batch
    if objective == "kto":  # the pairs unpaired: 8 examples, chosen desirable
        unpaired = data.parent / "unpaired.jsonl"
        unpaired.write_text("".join(
            json.dumps({"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"})
            + "\n" for r in records for side in ("chosen", "rejected")))
        c.data.files, c.data.format = str(unpaired), "unpaired_preference"
    c.train.update(objective=objective, batch_size=8 if objective == "kto" else 4, seq_len=64,
                   steps=STEPS, lr=LR,
                   schedule="linear", warmup_steps=0, weight_decay=0.0, b2=0.999, eps=EPS,
                   clip_norm=0.0, loss_chunk=8)
    c.preference.update(preference)
    return c


# ----- TRL ----------------------------------------------------------------------------

def trl_trainer(source, objective, tmp_path, peft_model=None, ref_model=None, **kw):
    from datasets import Dataset
    from transformers import AutoTokenizer

    folder, _, _, records = source
    common = dict(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True,
                  gradient_checkpointing=False, report_to=[], per_device_train_batch_size=4,
                  max_length=64, learning_rate=LR)
    tok = AutoTokenizer.from_pretrained(folder)
    ds = Dataset.from_list(records)
    model = peft_model if peft_model is not None else str(folder)
    if objective in ("dpo", "ipo"):
        args = trl.DPOConfig(**common, loss_type=["sigmoid" if objective == "dpo" else "ipo"],
                             **kw)
        return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=ds,
                              processing_class=tok)
    if objective == "kto":  # unpaired examples: every pair's chosen and rejected side
        unpaired = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                    for r in records for side in ("chosen", "rejected")]
        args = trl.KTOConfig(**{**common, "per_device_train_batch_size": len(unpaired)}, **kw)
        return trl.KTOTrainer(model=model, ref_model=ref_model, args=args,
                              train_dataset=Dataset.from_list(unpaired), processing_class=tok)
    if objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        return ORPOTrainer(model=model, args=ORPOConfig(**common, remove_unused_columns=False,
                                                        **kw),
                           train_dataset=ds, processing_class=tok)
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    return CPOTrainer(model=model, args=CPOConfig(**common, remove_unused_columns=False,
                                                  loss_type="simpo", **kw),
                      train_dataset=ds, processing_class=tok)


def trl_run(trainer, steps):
    """TRL's loss, metrics and gradients at each of ``steps`` steps of torch's AdamW with
    the linear schedule (the settings of ``config``); the batch is every pair."""
    batch = trainer._prepare_inputs(trainer.data_collator(
        [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]))
    model = trainer.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (steps - k) / steps)
    losses, metrics, grads = [], [], None
    # DPOTrainer keeps its metrics in _metrics, ORPO's and CPO's in _stored_metrics.
    store = getattr(trainer, "_metrics", None) or trainer._stored_metrics
    for _ in range(steps):
        store["train"].clear()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone().numpy() for n, p in model.named_parameters()
                     if p.requires_grad}
        losses.append(loss.item())
        metrics.append({k: float(np.mean([float(x) for x in v]))
                        for k, v in store["train"].items()})
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, metrics, grads, batch


# ----- ndjax ---------------------------------------------------------------------------

def first_step(exp):
    """(loss, metrics, float32 gradients of what trains) of step 1, on the host."""
    with open_loader(exp.data, rows=exp.local_rows, transform=exp.device_batch,
                     max_runs=exp.max_runs, prefetch=0) as data:
        return step_loss(exp, next(iter(data)))


def step_loss(exp, batch):
    """(loss, metrics, float32 gradients of what trains) of ``batch`` (in the batch
    sharding) at step 0, as the step computes them (its reference included), on the host."""
    state = exp.init_state()
    held = exp.held_reference(state)
    trainable, frozen = lora.split(state.params, exp.adapters_only, exp.saved_params)

    def fn(trainable, batch, held):
        def features(p, *args):
            return exp.features(lora.merge(frozen, p), *args)
        ref = reference_features(features, exp.step_options.reference, trainable, held)
        loss, _, grads, aux = loss_aux_and_grads(features, exp.step_options, trainable,
                                                 batch, reference=ref)
        return loss, aux, grads

    with rules_lib.use(exp.rules):
        loss, aux, grads = jax.device_get(jax.jit(fn)(trainable, batch, held))
    return float(loss), aux, grads


def run(exp, steps=STEPS):
    state = exp.init_state()
    step = exp.step_fn(exp.held_reference(state))
    losses, metrics = [], []
    with open_loader(exp.data, rows=exp.local_rows, transform=exp.device_batch,
                     max_runs=exp.max_runs, prefetch=0) as data:
        for _, batch in zip(range(steps), data):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
            metrics.append(jax.device_get(m))
    return losses, metrics


def hf_grads(exp, grads):
    """Full fine-tuning's gradients by HF name, in HF's layout."""
    return {name: get() for name, _, get in hf._tensors(jax.tree.map(jnp.asarray, grads),
                                                         exp.model_cfg)}


def assert_grads_equal(ours, theirs):
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    for name, g in ours.items():
        want = theirs[name]
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)


# The TRL metrics each objective logs that ndjax logs alike.
METRICS = {
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"),
    "orpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"),
    "simpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected", "nll_loss"),
}
METRICS["ipo"] = METRICS["dpo"]
METRICS["kto"] = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                  "logps/rejected", "logits/chosen", "logits/rejected")

CASES = {
    "dpo": ("dpo", {}, {"beta": 0.1}),
    "ipo": ("ipo", {"beta": 0.5}, {"beta": 0.5}),
    "orpo": ("orpo", {"beta": 0.2}, {"beta": 0.2}),
    "simpo": ("simpo", {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.3,
                        "label_smoothing": 0.1},
              {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.3, "label_smoothing": 0.1}),
    "kto": ("kto", {"beta": 0.2, "undesirable_weight": 1.5},
            {"beta": 0.2, "undesirable_weight": 1.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_losses_metrics_and_gradients_equal_trl(source, tmp_path, case):
    objective, ours_kw, trl_kw = CASES[case]
    exp = Experiment.from_config(config(source, objective, **ours_kw), jax.devices()[:1])
    trainer = trl_trainer(source, objective, tmp_path, **trl_kw)
    losses, metrics, grads, batch = trl_run(trainer, STEPS)

    loss, aux, our_grads = first_step(exp)
    np.testing.assert_allclose(loss, losses[0], rtol=1e-5)
    assert_grads_equal(hf_grads(exp, our_grads), grads)
    for k in METRICS[objective]:
        np.testing.assert_allclose(aux[k], metrics[0][k], rtol=1e-5, atol=1e-6, err_msg=k)

    ours, our_metrics = run(exp)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    # Rewards move off zero after step 1; they are beta x differences of sums of ~10
    # tokens' log-probabilities (~40 nats), hence an absolute bound beside the relative.
    for k in METRICS[objective]:
        np.testing.assert_allclose([m[k] for m in our_metrics], [m[k] for m in metrics],
                                   rtol=1e-4, atol=1e-4, err_msg=k)
    assert abs(losses[-1] - losses[0]) > 1e-3  # it trained: equality proves something


def peft_grads(exp, grads):
    """LoRA's gradients by PEFT's tensor names, in PEFT's layout."""
    g = jax.tree.map(jnp.asarray, grads)
    out = {}
    for name, path, i, split in hf._adapter_tensors(g, exp.model_cfg):
        x = hf._at(g, path)
        out[name] = np.asarray(x[i]).reshape(hf._hf_shape(x.shape[1:], split)[::-1]).T
    return out


@pytest.mark.parametrize("start, reference", [("trained", "auto"), ("zero_b", "adapters_off")])
def test_lora_dpo_equals_trls_reference_adapter(source, tmp_path, start, reference):
    """DPO after an SFT LoRA (adapters with B non-zero, model.lora.init_from): the
    reference is the starting adapters, as TRL's copy of them as its "ref" adapter. With B
    zero (fresh adapters), the adapters-off base is the same reference, without a copy."""
    import peft
    from transformers import AutoModelForCausalLM

    folder = source[0]
    targets = ["q_proj", "v_proj", "down_proj"]
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(folder), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and start == "trained":
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "peft")
    policy = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder),
                                            tmp_path / "peft", is_trainable=True)
    losses, metrics, grads, _ = trl_run(trl_trainer(source, "dpo", tmp_path,
                                                    peft_model=policy), STEPS)
    grads = {n.replace(".default.", "."): g for n, g in grads.items() if ".default." in n}

    c = config(source, "dpo", reference=reference)
    c.model.param_dtype = "float32"
    c.model.lora.update(rank=4, alpha=8.0, target_modules=",".join(targets),
                        init_from=str(tmp_path / "peft"))
    exp = Experiment.from_config(c, jax.devices()[:1])
    assert exp.reference_mode == ("held" if start == "trained" else "adapters_off")
    loss, aux, our_grads = first_step(exp)
    np.testing.assert_allclose(loss, losses[0], rtol=1e-5)
    assert_grads_equal(peft_grads(exp, our_grads), grads)
    for k in METRICS["dpo"]:
        np.testing.assert_allclose(aux[k], metrics[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    ours, _ = run(exp)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    assert abs(losses[-1] - losses[0]) > 1e-3


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_a_reference_from_another_checkpoint_equals_trls_ref_model(source, tmp_path,
                                                                   objective):
    """preference.ref_model (TRL's ref_model): another model of the same architecture, so
    that step 1's rewards, margins (and KTO's KL) are already far from 0."""
    from transformers import AutoModelForCausalLM

    make_hf(tmp_path / "ref", seed=3, vocab_size=300)
    trainer = trl_trainer(source, objective, tmp_path,
                          ref_model=AutoModelForCausalLM.from_pretrained(tmp_path / "ref"))
    losses, metrics, grads, _ = trl_run(trainer, 2)
    exp = Experiment.from_config(config(source, objective, ref_model=str(tmp_path / "ref")),
                                 jax.devices()[:1])
    loss, aux, our_grads = first_step(exp)
    assert abs(metrics[0]["rewards/margins"]) > 0.05
    np.testing.assert_allclose(loss, losses[0], rtol=1e-5)
    for k in METRICS[objective]:
        np.testing.assert_allclose(aux[k], metrics[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert_grads_equal(hf_grads(exp, our_grads), grads)
    np.testing.assert_allclose(run(exp, 2)[0], losses, rtol=1e-4)

    c = config(source, "dpo", ref_model=str(tmp_path / "ref"))
    make_hf(tmp_path / "other", vocab_size=300, hidden_size=32)
    c.preference.ref_model = str(tmp_path / "other")
    with pytest.raises(ConfigError, match="must be the policy's architecture"):
        Experiment.from_config(c, jax.devices()[:1])


def test_dpo_starts_at_log_2_and_its_rewards_move(source):
    """Policy = reference at step 1: the loss is ln 2 and the rewards 0, whatever the data."""
    losses, metrics = run(Experiment.from_config(config(source, "dpo"), jax.devices()[:1]), 3)
    np.testing.assert_allclose(losses[0], math.log(2), rtol=1e-6)
    assert metrics[0]["rewards/chosen"] == 0 and metrics[-1]["rewards/margins"] > 0


def test_qlora_dpo_starts_at_log_2(source):
    """Under QLoRA (an NF4 base) the adapters-off reference is the quantized base, as
    PEFT's disable_adapter on a 4-bit model: step 1's loss is ln 2."""
    c = config(source, "dpo")
    c.model.lora.update(rank=8, alpha=16.0, quantize="nf4", quant_block=8)
    exp = Experiment.from_config(c, jax.devices()[:1])
    assert exp.reference_mode == "adapters_off"
    loss, aux, grads = first_step(exp)
    np.testing.assert_allclose(loss, math.log(2), rtol=1e-6)
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))


def test_conservative_dpo_by_hand(source):
    """label_smoothing eps: -(1-eps) log sigmoid(beta d) - eps log sigmoid(-beta d) (cDPO;
    TRL 1.16's sigmoid loss has dropped it). At step 1 d = 0: still ln 2; its gradient is
    (1 - 2 eps) x plain DPO's."""
    plain = first_step(Experiment.from_config(config(source, "dpo"), jax.devices()[:1]))
    smooth = first_step(Experiment.from_config(config(source, "dpo", label_smoothing=0.2),
                                               jax.devices()[:1]))
    np.testing.assert_allclose(smooth[0], math.log(2), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(smooth[2]), jax.tree.leaves(plain[2])):
        np.testing.assert_allclose(a, 0.6 * b, rtol=0, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("objective", ["dpo", "orpo", "kto"])
def test_layouts_and_grad_accum_give_one_devices_first_step(source, objective):
    """fsdp x tensor, with context parallelism (ring attention's zigzag order: a pair's
    tokens spread over the context shards), and grad_accum. KTO's KL is its micro-batch's
    (as TRL's): grad_accum changes it, layouts do not."""
    one = first_step(Experiment.from_config(config(source, objective), jax.devices()[:1]))
    layouts = ((dict(fsdp=4, tensor=2), 1), (dict(fsdp=2, context=2, tensor=2), 1), (None, 2))
    for mesh, accum in layouts[:2 if objective == "kto" else 3]:
        c = config(source, objective, mesh=mesh)
        c.train.grad_accum = accum
        devices = jax.devices()[:8] if mesh else jax.devices()[:1]
        other = first_step(Experiment.from_config(c, devices))
        np.testing.assert_allclose(other[0], one[0], rtol=1e-5)
        for k in METRICS[objective]:
            np.testing.assert_allclose(other[1][k], one[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
        for a, b in zip(jax.tree.leaves(other[2]), jax.tree.leaves(one[2])):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_token_log_probs_gradient_equals_autodiff():
    """Any cotangent of the per-token log-probabilities, through the chunked head's custom
    VJP, one device and fsdp x tensor (the head vocabulary-parallel)."""
    rng = np.random.default_rng(0)
    b, s, d, v = 8, 16, 32, 64
    x = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(b, s)), jnp.float32)

    def dense(x, head):
        logp = jax.nn.log_softmax(jnp.einsum("bsd,dv->bsv", x, head), -1)
        return jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * g)

    def chunked(x, head):
        logps, means = token_log_probs(x, head, targets, chunk=4)
        return jnp.sum(logps * g) + 0.0 * jnp.sum(means)

    want = jax.value_and_grad(dense, argnums=(0, 1))(x, head)
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2)))
    for rules in (None, exp.rules):
        with rules_lib.use(rules) if rules else contextlib.nullcontext():
            got = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(x, head)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, w in zip(got[1], want[1]):
            np.testing.assert_allclose(a, w, atol=1e-5)


@pytest.mark.parametrize("change, says", [
    ({"train.objective": "dpo", "data.format": "chat"}, "data.format=preference"),
    ({"train.objective": "sft"}, "train.objective to one of"),
    ({"train.objective": "kto"}, "data.format=unpaired_preference"),
    ({"train.objective": "orpo", "preference.reference": "frozen_copy"}, "uses no reference"),
    ({"preference.reference": "adapters_off"}, "model.lora.rank is unset"),
    ({"train.eval_every": 2}, "not built yet"),
])
def test_bad_settings_are_one_line(source, change, says):
    c = config(source, "dpo")
    for key, value in change.items():
        group, field = key.split(".")
        c[group][field] = value
    with pytest.raises(ConfigError, match=says) as e:
        Experiment.from_config(c, jax.devices()[:1])
    assert "\n" not in str(e.value)


def test_a_run_logs_trls_metrics_and_resumes_with_the_same_reference(source, tmp_path,
                                                                      capsys):
    """train.py's loop: metrics.jsonl and the step line hold the rewards; a run stopped
    at step 2 and
    resumed goes on bit for bit (the held reference is step 0's parameters again,
    re-read from model.init_from, not the checkpoint's)."""
    from ndjax.training.loop import train

    def run(workdir, verbose=False):
        c = config(source, "dpo")
        c.train.steps, c.checkpoint.every, c.log.tensorboard = 3, 2, False
        c.checkpoint.async_save = False
        return train(c, str(workdir), devices=jax.devices()[:1], verbose=verbose)

    straight = run(tmp_path / "a", verbose=True)
    assert "step 1/3  loss 0.6931  margin 0.0000  accuracy 0%" in capsys.readouterr().out
    shutil.copytree(tmp_path / "a" / "checkpoints" / "2", tmp_path / "b" / "checkpoints" / "2")
    resumed = run(tmp_path / "b")
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["loss"] == straight[2]["loss"]
    logged = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    steps = [r for r in logged if "rewards/margins" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["rewards/margins"] == 0 < steps[2]["rewards/margins"]
    assert {"rewards/chosen", "rewards/accuracies", "logps/rejected",
            "logits/chosen"} <= set(steps[0])
