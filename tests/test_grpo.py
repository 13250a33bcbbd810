"""GRPO (train.objective=grpo) against TRL 1.16's GRPOTrainer, float32.

Checked: for a fixed batch of prompts, completions, advantages, old and reference
log-probabilities (perturbed, so that the ratio's clipping and the KL term are active),
the loss and every gradient equal TRL's ``compute_loss`` for each ``loss_type`` (dapo,
grpo, bnpo, dr_grpo), at temperature 0.7 (loss within 1e-5 of its terms' scale, the mean
|advantage|, as advantages of both signs cancel in it; gradients 1e-5 of each parameter's
largest), on one device and on fsdp x tensor. Not checked here: sampling
and rewards (tests/test_grpo_run.py).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import trl
from conftest import tiny_config
from data_files import texts, write_tokenizer
from test_hf import make_hf
from test_preference import assert_grads_equal, hf_grads, step_loss

from ndjax.experiment import Experiment

EOS = "<|endoftext|>"
B, P, C, S = 4, 5, 6, 16  # rows, prompt tokens, completion slots, row length
TEMPERATURE, EPS_LOW, EPS_HIGH, BETA = 0.7, 0.2, 0.28, 0.05


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo")
    path = write_tokenizer(folder / "tokenizer.json", texts(24))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": "<pad>"}))
    make_hf(folder, vocab_size=300)
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t[:20]}) + "\n" for t in texts(8)))
    return folder, path, data


def rollouts(seed=0):
    """Prompts (B, P), completions (B, C) with their masks (lengths 3..6), advantages,
    and old and reference log-probabilities as offsets from the policy's."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(2, 300, (B, P))
    completions = rng.integers(2, 300, (B, C))
    lengths = np.array([6, 3, 5, 4])
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int64)
    advantages = rng.normal(size=B).astype(np.float32)
    old_offset = rng.normal(scale=0.3, size=(B, C)).astype(np.float32)
    ref_offset = rng.normal(scale=0.3, size=(B, C)).astype(np.float32)
    return prompts, completions, mask, advantages, old_offset, ref_offset


def trl_loss(source, tmp_path, loss_type):
    from datasets import Dataset
    from transformers import AutoTokenizer

    folder = source[0]
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True,
                          gradient_checkpointing=False, report_to=[],
                          per_device_train_batch_size=B, num_generations=2,
                          max_completion_length=C, loss_type=loss_type, beta=BETA,
                          epsilon=EPS_LOW, epsilon_high=EPS_HIGH, temperature=TEMPERATURE)
    tr = trl.GRPOTrainer(model=str(folder), reward_funcs=lambda completions, **kw: [0.0] * len(
        completions), args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * B),
                         processing_class=AutoTokenizer.from_pretrained(folder))
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    prompts, completions, mask, advantages, old_offset, ref_offset = rollouts()
    ids = torch.tensor(np.concatenate([prompts, completions], 1))
    with torch.no_grad():  # the policy's own log-probabilities, to offset old and ref from
        logits = tr.model(ids).logits[:, P - 1:-1] / TEMPERATURE
        logps = torch.gather(logits.log_softmax(-1), 2, ids[:, P:, None])[..., 0].numpy()
    inputs = dict(prompt_ids=torch.tensor(prompts), prompt_mask=torch.ones(B, P, dtype=torch.long),
                  completion_ids=torch.tensor(completions), completion_mask=torch.tensor(mask),
                  advantages=torch.tensor(advantages),
                  old_per_token_logps=torch.tensor(logps + old_offset),
                  ref_per_token_logps=torch.tensor(logps + ref_offset),
                  num_items_in_batch=torch.tensor(mask.sum()))
    loss = tr.compute_loss(tr.model, inputs)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in tr.model.named_parameters()}
    return loss.item(), grads, logps


def config(source, loss_type, mesh=None):
    folder, path, data = source
    c = tiny_config(mesh=mesh)
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "rope_theta"):
        c.model[field] = None
    c.model.init_from = str(folder)
    c.data.source, c.data.files, c.data.tokenizer = "chat", str(data), str(path)
    c.data.format = "prompt"
    c.train.update(objective="grpo", batch_size=B, seq_len=S, loss_chunk=8)
    c.grpo.update(num_generations=2, max_completion_length=C, loss_type=loss_type, beta=BETA,
                  epsilon=EPS_LOW, epsilon_high=EPS_HIGH, temperature=TEMPERATURE,
                  reward_funcs="ndjax.rewards.format.think_answer")
    return c


def ndjax_batch(logps):
    """The same rollouts as ndjax's rows: prompt + completion, the completion's targets
    learned, each row's advantage on its every position, old and reference
    log-probabilities at the positions whose targets they score."""
    prompts, completions, mask, advantages, old_offset, ref_offset = rollouts()
    tokens = np.zeros((B, S + 1), np.int32)
    tokens[:, :P + C] = np.concatenate([prompts, completions], 1)
    real = np.zeros((B, S + 1), np.int32)
    real[:, :P] = 1
    real[:, P:P + C] = mask
    learned = np.zeros((B, S), np.int32)
    learned[:, P - 1:P - 1 + C] = mask
    scored = np.zeros((B, S), np.float32)
    old, ref = scored.copy(), scored.copy()
    old[:, P - 1:P - 1 + C] = logps + old_offset
    ref[:, P - 1:P - 1 + C] = logps + ref_offset
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(),
            "segment_ids": real[:, :-1], "loss_mask": learned,
            "advantages": np.repeat(advantages[:, None], S, 1),
            "old_logps": old, "ref_logps": ref}


def ndjax_loss(exp, batch):
    return step_loss(exp, {k: jax.device_put(v, exp.batch_sharding) for k, v in batch.items()})


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_loss_and_gradients_equal_trls(source, tmp_path, loss_type):
    want, want_grads, logps = trl_loss(source, tmp_path, loss_type)
    batch = ndjax_batch(logps)
    # Advantages of both signs cancel in the loss: its tolerance is 1e-5 of its terms' scale.
    scale = np.abs(rollouts()[3]).mean()
    for mesh in (None, dict(fsdp=2, tensor=2)) if loss_type == "dapo" else (None,):
        devices = jax.devices()[:4 if mesh else 1]
        exp = Experiment.from_config(config(source, loss_type, mesh), devices)
        loss, aux, grads = ndjax_loss(exp, batch)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-5 * scale)
        assert_grads_equal(hf_grads(exp, grads), want_grads)
        assert aux["clip_ratio/region_mean"] > 0 and aux["kl"] > 0  # both terms active


def test_on_policy_ratio_is_one_with_its_gradient(source):
    """Without old log-probabilities (one gradient step per rollout batch) the ratio is 1:
    the loss is -mean(A) over the tokens, and its gradient the policy gradient."""
    batch = ndjax_batch(np.zeros((B, C), np.float32))
    del batch["old_logps"], batch["ref_logps"]
    c = config(source, "dapo")
    c.grpo.beta = 0.0
    exp = Experiment.from_config(c, jax.devices()[:1])
    loss, aux, grads = ndjax_loss(exp, batch)
    mask, adv = batch["loss_mask"], batch["advantages"]
    np.testing.assert_allclose(loss, -(adv * mask).sum() / mask.sum(), rtol=1e-6)
    assert aux["clip_ratio/region_mean"] == 0
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
    assert "kl" not in aux and jnp.isfinite(loss)
