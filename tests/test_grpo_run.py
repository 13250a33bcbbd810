"""GRPO end to end: ndjax's sampler on the training mesh, reward functions, train.py's loop.

Checked: a step's rollouts are a function of the seed and the step, the same on one
device and on fsdp x tensor; 30 steps on a synthetic verifiable task (even token ids)
raise the mean reward; a resumed run goes on with the same rollouts and losses; bad
settings are one line before anything compiles. Not checked here: the loss against TRL
(tests/test_grpo.py)."""

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from data_files import texts, write_tokenizer

from ndjax.data.loader import open_loader
from ndjax.experiment import Experiment
from ndjax.runtime.errors import ConfigError
from ndjax.training import grpo
from ndjax.training.loop import train

REWARD = "grpo_rewards.even_tokens"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo_run")
    path = write_tokenizer(folder / "tokenizer.json", texts(24))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "pad_token": "<pad>"}))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t.split(":")[1][:24]}) + "\n"
                               for t in texts(32)))
    return path, prompts


def config(data, mesh=None, **grpo_settings):
    path, prompts = data
    c = tiny_config(mesh=mesh, model=dict(vocab_size=384),
                    train=dict(objective="grpo", batch_size=16, seq_len=32, lr=3e-3,
                               steps=30, schedule="constant", warmup_steps=0))
    c.data.update(source="chat", files=str(prompts), tokenizer=str(path), format="prompt")
    c.grpo.update(dict(num_generations=4, max_completion_length=8, reward_funcs=REWARD,
                       **grpo_settings))
    c.log.tensorboard = False
    c.checkpoint.async_save = False
    return c


def first_rollouts(exp):
    state = exp.init_state()
    with open_loader(exp.data, rows=(0, exp.data.batches.batch_size), prefetch=0) as loader:
        prompts = next(iter(loader))
        rows, metrics = grpo.Rollouts(exp, loader.source)(state.params, 0, prompts)
    return rows, metrics


def test_rollouts_depend_on_the_seed_and_step_not_the_layout(data):
    one = Experiment.from_config(config(data), jax.devices()[:1])
    rows, metrics = first_rollouts(one)
    again, _ = first_rollouts(one)
    other, _ = first_rollouts(Experiment.from_config(config(data, mesh=dict(fsdp=2, tensor=2)),
                                                     jax.devices()[:4]))
    for k in rows:
        np.testing.assert_array_equal(rows[k], again[k], err_msg=k)
        np.testing.assert_allclose(rows[k], other[k], rtol=1e-6, err_msg=k)
    assert 0 < metrics["reward"] < 1 and metrics["completions/mean_length"] > 1
    # Each prompt's 4 completions differ (sampled at temperature 1), their advantages sum
    # to 0 in each group.
    adv = rows["advantages"][:, 0].reshape(-1, 4)
    np.testing.assert_allclose(adv.sum(1), 0, atol=1e-5)


def test_thirty_steps_raise_the_reward_and_a_resume_goes_on_alike(data, tmp_path):
    records = train(config(data), str(tmp_path / "a"), devices=jax.devices()[:1], verbose=False)
    reward = [r["reward"] for r in records]
    assert np.mean(reward[-5:]) > np.mean(reward[:5]) + 0.1, reward
    assert {"rollout_tokens_per_sec", "clip_ratio/region_mean", "frac_reward_zero_std",
            "rewards/even_tokens/mean"} <= set(records[0])

    c = config(data)
    c.train.steps, c.checkpoint.every = 4, 2
    straight = train(c, str(tmp_path / "b"), devices=jax.devices()[:1], verbose=False)
    shutil.copytree(tmp_path / "b" / "checkpoints" / "2", tmp_path / "c" / "checkpoints" / "2")
    resumed = train(c, str(tmp_path / "c"), devices=jax.devices()[:1], verbose=False)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [(r["loss"], r["reward"]) for r in resumed] == [
        (r["loss"], r["reward"]) for r in straight[2:]]


@pytest.mark.parametrize("change, says", [
    ({"grpo.reward_funcs": ""}, "needs reward functions"),
    ({"grpo.reward_funcs": "no_such_module.fn"}, "no_such_module"),
    ({"train.batch_size": 10}, "does not divide it"),
    ({"data.format": "chat"}, "data.format=prompt"),
    ({"grpo.max_completion_length": 40}, "leaves no room"),
])
def test_bad_settings_are_one_line_before_compiling(data, change, says):
    c = config(data)
    for key, value in change.items():
        group, field = key.split(".")
        c[group][field] = value
    with pytest.raises(ConfigError, match=says) as e:
        Experiment.from_config(c, jax.devices()[:1])
    assert "\n" not in str(e.value)


def test_num_iterations_trains_twice_on_each_batch_of_rollouts(data, tmp_path):
    """grpo.num_iterations=2: steps 1-2 share rollouts, as do 3-4 (the same reward logged);
    step 1's ratio is to the sampling policy's own log-probabilities, so its loss is
    num_iterations=1's; step 2's policy has moved off them, and the clip can act."""
    c = config(data, num_iterations=1)
    c.train.steps = 1
    one = train(c, str(tmp_path / "one"), devices=jax.devices()[:1], verbose=False)
    c = config(data, num_iterations=2)
    c.train.steps = 4
    two = train(c, str(tmp_path / "two"), devices=jax.devices()[:1], verbose=False)
    assert two[0]["reward"] == two[1]["reward"] == one[0]["reward"]
    assert two[2]["reward"] == two[3]["reward"] != two[1]["reward"]
    np.testing.assert_allclose(two[0]["loss"], one[0]["loss"], rtol=1e-5, atol=1e-7)
    assert two[1]["rollout_time"] == 0 < two[0]["rollout_time"]


def test_qlora_samples_with_its_adapters_and_its_kl_is_to_the_base(data, tmp_path):
    """Under QLoRA (LoRA over an NF4 base) the sampler runs the adapters being trained, and
    the KL is to the base with the adapters off: 0 at step 1 (fresh adapters are the
    base), > 0 once they trained."""
    c = config(data, beta=0.1)
    c.train.steps = 3
    c.model.lora.update(rank=8, alpha=16.0, quantize="nf4", quant_block=8)
    records = train(c, str(tmp_path / "qlora"), devices=jax.devices()[:1], verbose=False)
    assert records[0]["kl"] == 0 < records[2]["kl"]
    assert all(np.isfinite(r["loss"]) for r in records)


def test_what_was_left_out_for_length_is_named_by_the_datas_kind(data):
    """The start-up line that counts what data.overlong left out says what it counted."""
    from ndjax.config import Settings
    from ndjax.training.loop import _overlong

    c = config(data)
    assert _overlong(Settings.parse(c)) == ("prompts longer than the prompt budget, "
                                            "train.seq_len - grpo.max_completion_length = "
                                            "24 tokens")
    c.train.objective, c.data.format = "dpo", "preference"
    assert _overlong(Settings.parse(c)).startswith("preference pairs longer than "
                                                   "train.seq_len + 1 = 33 tokens")
