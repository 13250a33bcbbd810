"""ndjax from_axolotl on Axolotl's preference training (rl: dpo, ipo, orpo, simpo, kto)
and GRPO: the objective and its TRL settings (preference.*, grpo.*), the preference
dataset types as data.format=preference, KTO's records as unpaired_preference, GRPO's
prompts as data.format=prompt, sequence_len as a pair's row, and every refusal (rl: gdpo
and ebft, Axolotl's template-rendering dataset types and GRPO transforms, TRL settings
ndjax lacks) one line each, all in one report. A converted DPO run under LoRA trains,
from ln 2."""

from __future__ import annotations

import json
import math
import re
import shutil

import jax
import numpy as np
import pytest
import yaml
from conftest import tiny_config
from data_files import write_chat_tokenizer

from ndjax.axolotl import grpo as axolotl_grpo
from ndjax.experiment import Experiment
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.verbs import from_axolotl

VOCAB = 384  # the chat tokenizer's 360 ids fit
# head_dim 64: QLoRA's NF4 blocks of 64 run along each weight's last dimension.
MODEL = dict(vocab_size=VOCAB, dim=128, n_heads=2, n_kv_heads=1)

# In the shape of Axolotl's examples/llama-3/instruct-dpo-lora-8b.yml.
DPO_YAML = """\
base_model: {hf}
model_type: LlamaForCausalLM
chat_template: llama3
rl: dpo
rl_beta: 0.05
datasets:
  - path: {messages}
    type: chat_template.default
    field_messages: conversation
    field_chosen: chosen
    field_rejected: rejected
    message_property_mappings:
      role: role
      content: content
    roles:
      user: [user]
      assistant: [assistant]
val_set_size: 0.05
output_dir: ./outputs/dpo
sequence_len: 48
sample_packing: false
adapter: lora
lora_r: 8
lora_alpha: 16
lora_target_linear: true
micro_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 2
learning_rate: 1e-3
eval_steps: 10
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny random Llama with a chat tokenizer (Llama 3 template), and preference
    records of each shape: strings, messages with chosen/rejected replies, and whole
    chosen/rejected conversations (argilla's, beside a string prompt column)."""
    root = tmp_path_factory.mktemp("axolotl_rl")
    tokenizer = write_chat_tokenizer(root / "tokenizer")
    exp = Experiment.from_config(tiny_config(model=MODEL), jax.devices()[:1])
    hf.export(exp.init_state().params, exp.model_cfg, str(root / "hf"), "float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer.parent / name, root / "hf")
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    say = lambda: " ".join(rng.choice(words, rng.integers(2, 5)))  # noqa: E731
    strings, messages, argilla, kto, prompts = [], [], [], [], []
    for i in range(8):
        prompt, chosen, rejected = f"{say()}?", say(), say()
        user = {"role": "user", "content": prompt}
        strings.append({"prompt": prompt, "chosen": f" {chosen}", "rejected": f" {rejected}"})
        messages.append({"conversation": [user],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        argilla.append({"prompt": prompt,
                        "chosen": [user, {"role": "assistant", "content": chosen}],
                        "rejected": [user, {"role": "assistant", "content": rejected}]})
        kto.append({"prompt": prompt, "completion": f" {chosen}", "label": i % 3 != 0})
        prompts.append({"prompt": [user], "answer": str(i)})
    paths = {}
    for name, records in (("strings", strings), ("messages", messages), ("argilla", argilla),
                          ("kto", kto), ("prompts", prompts)):
        paths[name] = str(root / f"{name}.jsonl")
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"hf": str(root / "hf"), **paths}


def assert_every_field_accounted_for(raw: dict, conv: from_axolotl.Conversion) -> None:
    """Each Axolotl key (top level and in each dataset) is named by a mapped setting's
    note or listed as unmapped: nothing is dropped silently."""
    unmapped = {u.field for u in conv.unmapped}
    notes = " ".join(conv.notes.values())
    for key in raw:
        listed = key in unmapped or any(u.startswith((f"{key}[", f"{key}.")) for u in unmapped)
        assert listed or re.search(rf"\b{key}\b", notes), key
    for i, entry in enumerate(raw["datasets"]):
        for key in entry:
            assert f"datasets[{i}].{key}" in unmapped or key in ("path", "type") or \
                f"datasets[].{key}" in notes, (i, key)


def convert(files, change=None, drop=()):
    raw = {**yaml.safe_load(DPO_YAML.format(**files)), **(change or {})}
    for key in drop:
        raw.pop(key)
    return raw, from_axolotl.convert(raw, devices=1)


def check(conv):
    text = from_axolotl.render(conv, "config.yml")
    from_axolotl.check(text, conv)
    return text


def test_dpo_lora_converts_builds_and_trains_from_log_2(files):
    """Axolotl's DPO under LoRA on chat_template.default records: train.objective=dpo,
    rl_beta as preference.beta, the records' messages as the prompt, sequence_len x 2
    per row (one pair a row), the base with the adapters off as the reference; the
    evaluation fields are listed. Two steps train: ln 2 first (policy = reference)."""
    raw, conv = convert(files)
    o = conv.overrides
    assert (o["train.objective"], o["preference.beta"], o["preference.reference"]) == (
        "dpo", 0.05, "auto")
    assert "adapters off" in conv.notes["preference.reference"]
    assert (o["data.source"], o["data.format"], o["data.files"]) == (
        "chat", "preference", files["messages"])
    assert (o["data.prompt_field"], o["data.chosen_field"], o["data.rejected_field"],
            o["data.chat_template"]) == ("conversation", "chosen", "rejected", "llama3")
    assert (o["train.seq_len"], o["data.packing"], o["data.overlong"]) == (96, False, "drop")
    assert (o["train.batch_size"], o["train.grad_accum"]) == (2 * 2, 2)  # pairs
    assert "train.eval_every" not in o and "data.eval_fraction" not in o
    reasons = {u.field: u.reason for u in conv.unmapped}
    assert set(reasons) == {"model_type", "datasets[0].roles", "val_set_size", "eval_steps"}
    assert "preference objectives" in reasons["val_set_size"]
    assert_every_field_accounted_for(raw, conv)
    text = check(conv)
    assert "c.preference.beta = 0.05  # rl_beta (DPO's beta)" in text

    config = from_axolotl.load(text)
    config.export.adapter_dir = None  # the test writes no export
    exp = Experiment.from_config(config, jax.devices()[:1])
    from ndjax.data.loader import open_loader
    state = exp.init_state()
    step = exp.step_fn(exp.held_reference(state))
    losses = []
    with open_loader(exp.data, rows=exp.local_rows, transform=exp.device_batch,
                     max_runs=exp.max_runs, prefetch=0) as data:
        for _, batch in zip(range(2), data):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], math.log(2), rtol=1e-5)
    assert losses[1] != losses[0] and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("change, drop, expect, note", [
    # rl: ipo, full fine-tuning: trl.beta is IPO's tau; the reference a frozen copy.
    ({"rl": "ipo", "trl": {"beta": 0.3, "max_completion_length": 32}},
     ("adapter", "lora_r", "lora_alpha", "lora_target_linear"),
     {"train.objective": "ipo", "preference.beta": 0.3},
     {"preference.reference": "frozen copy"}),
    # dpo_loss_type ['ipo'] under rl: dpo is IPO; trl.beta is read before rl_beta.
    ({"dpo_loss_type": ["ipo"], "trl": {"beta": 0.2}}, (),
     {"train.objective": "ipo", "preference.beta": 0.2}, {"train.objective": "dpo_loss_type"}),
    # conservative DPO under QLoRA, records of prompt, chosen and rejected strings.
    ({"dpo_label_smoothing": 0.1, "adapter": "qlora", "dpo_use_liger_kernel": True,
      "precompute_ref_log_probs": True, "datasets": [{"path": "{strings}"}]}, (),
     {"train.objective": "dpo", "preference.label_smoothing": 0.1,
      "model.lora.quantize": "nf4", "data.prompt_field": "prompt"},
     {"preference.label_smoothing": "cDPO"}),
    # ORPO on argilla's conversations (the implicit prompt): orpo_alpha is TRL's beta.
    ({"rl": "orpo", "orpo_alpha": 0.2, "rl_beta": None,
      "datasets": [{"path": "{argilla}", "type": "chat_template.argilla"}]}, (),
     {"train.objective": "orpo", "preference.beta": 0.2, "data.prompt_field": ""},
     {"preference.beta": "ORPO's lambda"}),
    # SimPO (CPOTrainer): gamma and alpha; argilla_chat's conversations for DPO trainers.
    ({"rl": "simpo", "simpo_gamma": 1.0, "cpo_alpha": 0.0, "rl_beta": 2.0,
      "datasets": [{"path": "{argilla}", "type": "chat_template.argilla_chat"}]}, (),
     {"train.objective": "simpo", "preference.beta": 2.0, "preference.simpo_gamma": 1.0,
      "preference.cpo_alpha": 0.0, "data.prompt_field": ""},
     {"preference.cpo_alpha": "cpo_alpha"}),
], ids=["ipo_full", "dpo_loss_type_ipo", "cdpo_qlora_strings", "orpo_argilla", "simpo"])
def test_each_objective_converts_and_passes_ndjaxs_checks(files, change, drop, expect, note):
    change = {k: [{kk: vv.format(**files) for kk, vv in e.items()} for e in v]
              if k == "datasets" else v for k, v in change.items()}
    raw, conv = convert(files, change, drop)
    o = conv.overrides
    for path, value in expect.items():
        assert o[path] == value, (path, o.get(path))
    for path, words in note.items():
        assert words in conv.notes[path], conv.notes[path]
    if o["train.objective"] in ("orpo", "simpo"):
        assert "preference.reference" not in o
    assert_every_field_accounted_for(raw, conv)
    check(conv)


def test_lora_model_dir_is_the_reference_said_so(files):
    """With trained adapters (lora_model_dir) the run starts from and references them,
    as TRL does with a PeftModel; the note says Axolotl's DPO does not load them."""
    _, conv = convert(files, {"lora_model_dir": "runs/sft"})
    assert conv.overrides["model.lora.init_from"] == "runs/sft"
    assert "does not load lora_model_dir" in conv.notes["preference.reference"]


@pytest.mark.parametrize("rl, says", [
    ("gdpo", "rl: 'gdpo': GDPO"),
    ("ebft", "rl: 'ebft': EBFT"),
    ("ppo", "rl: 'ppo' must be one of dpo, ipo, orpo, simpo, kto, grpo"),
])
def test_other_rl_methods_are_one_line(files, rl, says):
    """The datasets of a refused rl are not read: rl is the only problem."""
    with pytest.raises(ConfigError) as e:
        convert(files, {"rl": rl})
    assert len(e.value.conversion.problems) == 1, e.value.conversion.problems
    assert str(e.value).startswith(says)
    assert "datasets" in {u.field for u in e.value.conversion.unmapped}


def test_every_refusal_is_one_line_in_one_report(files):
    """Axolotl's template-rendering dataset types, TRL losses ndjax lacks, WPO weighting,
    RPO, excess_length_strategy: raise and a non-default messages mapping: each one line
    naming the field, the value and a fix, all at once."""
    change = {"dpo_loss_type": ["hinge"], "dpo_use_weighting": True, "rpo_alpha": 0.5,
              "excess_length_strategy": "raise", "rl_beta": 0,
              "datasets": [
                  {"path": files["strings"], "type": "chatml.intel"},
                  {"path": files["messages"], "type": "llama3.argilla_chat"},
                  {"path": files["argilla"], "type": "chat_template.argilla"},
                  {"path": files["messages"], "type": "chat_template.default",
                   "message_property_mappings": {"role": "from", "content": "value"}},
                  {"path": files["strings"], "type": "alpaca"}]}
    with pytest.raises(ConfigError) as e:
        convert(files, change)
    problems = e.value.conversion.problems
    expected = [
        "dpo_loss_type: [\"hinge\"] must be ['sigmoid'] (DPO) or ['ipo'] (IPO)",
        "rl_beta: 0 must be a number > 0",
        "dpo_use_weighting: true must be false; ndjax has no WPO weighting",
        "rpo_alpha: 0.5 must be unset; ndjax's DPO has no RPO term",
        "datasets[0].type: 'chatml.intel' renders Axolotl's own chatml prompt strings",
        "datasets[1].type: 'llama3.argilla_chat' renders Axolotl's own llama3 prompt strings",
        "datasets[2].type: 'chat_template.argilla' is rl: orpo's type; for rl: dpo, chosen "
        "and rejected conversations are type chat_template.argilla_chat.",
        "datasets[3].message_property_mappings: {\"role\": \"from\", \"content\": \"value\"} "
        "must be {role: role, content: content} for preference pairs",
        "datasets[4].type: 'alpaca' is not a preference dataset type ndjax reads for rl: dpo",
        "excess_length_strategy: 'raise' must be drop or truncate for preference pairs",
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for line, start in zip(problems, expected):
        assert line.startswith(start), (line, start)
        assert "\n" not in line
    assert "use type chat_template.default" in problems[4]


def test_orpo_refuses_the_dpo_trainers_types(files):
    with pytest.raises(ConfigError, match=r"^datasets\[0\].type: 'chat_template.default' is a "
                       r"type of Axolotl's DPO trainers, not of rl: orpo; use type "
                       r"chat_template.argilla"):
        convert(files, {"rl": "orpo"})


def test_rl_fields_without_rl_are_listed(files):
    """SFT (no rl): rl_beta and the other preference fields are listed as unread."""
    raw = {**yaml.safe_load(DPO_YAML.format(**files)), "rl": None, "dpo_label_smoothing": 0.1,
           "datasets": [{"path": files["strings"], "type": "completion", "field": "prompt"}]}
    conv = from_axolotl.convert(raw, devices=1)
    reasons = {u.field: u.reason for u in conv.unmapped}
    assert "train.objective" not in conv.overrides and conv.overrides["train.seq_len"] == 48
    for key in ("rl_beta", "dpo_label_smoothing"):
        assert reasons[key].startswith("a preference-training setting"), reasons


# In the shape of Axolotl's examples/llama-3/qlora-1b-kto.yaml, under LoRA.
KTO = {"rl": "kto", "rl_beta": 0.5, "kto_desirable_weight": 0.2, "remove_unused_columns": False,
       "datasets": [{"path": "{kto}"}]}


def test_kto_lora_converts_and_passes_ndjaxs_checks(files):
    """rl: kto: KTO's beta and weights (Axolotl's `or 1.0` for an unset one), records of
    prompt, completion and label as data.format=unpaired_preference, an example and its
    KL sequence a row, the base with the adapters off as the reference."""
    raw, conv = convert(files, {**KTO, "datasets": [{"path": files["kto"]}]})
    o = conv.overrides
    assert (o["train.objective"], o["preference.beta"], o["preference.desirable_weight"],
            o["preference.undesirable_weight"], o["preference.reference"]) == (
        "kto", 0.5, 0.2, 1.0, "auto")
    assert (o["data.format"], o["data.prompt_field"], o["data.completion_field"],
            o["data.label_field"], o["data.files"]) == (
        "unpaired_preference", "prompt", "completion", "label", files["kto"])
    assert (o["train.seq_len"], o["data.packing"], o["train.batch_size"]) == (96, False, 4)
    assert "KL partner" in conv.notes["train.batch_size"]
    assert "Axolotl's `or 1.0`" in conv.notes["preference.undesirable_weight"]
    assert_every_field_accounted_for(raw, conv)
    assert "c.preference.desirable_weight = 0.2" in check(conv)


def test_kto_dataset_types_are_refused_one_line_each(files):
    """Axolotl's KTO strategies render their own template strings; a DPO type is none
    of KTO's. Each is one line naming what to give instead."""
    with pytest.raises(ConfigError) as e:
        convert(files, {**KTO, "kto_undesirable_weight": -1, "datasets": [
            {"path": files["kto"], "type": "llama3.ultra"},
            {"path": files["kto"], "type": "chat_template.default"}]})
    problems = e.value.conversion.problems
    expected = ["kto_undesirable_weight: -1 must be a number >= 0",
                "datasets[0].type: 'llama3.ultra' renders Axolotl's own llama3 prompt strings",
                "datasets[1].type: 'chat_template.default' is not a KTO dataset type"]
    assert len(problems) == len(expected), "\n".join(problems)
    for line, start in zip(problems, expected):
        assert line.startswith(start) and "\n" not in line, (line, start)
    assert "records of prompt, completion and label" in problems[1]


# In the shape of Axolotl's docs/grpo.qmd example, with records already holding a prompt.
GRPO = {"rl": "grpo", "rl_beta": None, "chat_template": "llama3", "datasets": [{"path": ""}],
        "trl": {"use_vllm": True, "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000,
                "beta": 0.04, "num_generations": 4, "max_completion_length": 16,
                "temperature": 0.7, "top_p": 0.9, "top_k": 20, "loss_type": "grpo",
                "reward_funcs": ["ndjax.rewards.math.accuracy"], "reward_weights": [2.0],
                "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": False,
                "mask_truncated_completions": True, "log_completions": True}}


def grpo(files, trl=None, **change):
    return convert(files, {**GRPO, "datasets": [{"path": files["prompts"]}],
                           "trl": {**GRPO["trl"], **(trl or {})}, **change})


def test_grpo_lora_converts_and_passes_ndjaxs_checks(files):
    """rl: grpo: trl's settings as grpo.*, reward_funcs joined, scale_rewards false as
    none, records of a prompt as data.format=prompt, sequence_len + max_completion_length
    as the row (a prompt of up to sequence_len tokens and its completion), the batch in
    completions; use_vllm listed as not mapped."""
    raw, conv = grpo(files)
    o = conv.overrides
    assert o["train.objective"] == "grpo"
    assert {k: v for k, v in o.items() if k.startswith("grpo.")} == {
        "grpo.num_generations": 4, "grpo.max_completion_length": 16, "grpo.temperature": 0.7,
        "grpo.top_p": 0.9, "grpo.top_k": 20, "grpo.reward_funcs": "ndjax.rewards.math.accuracy",
        "grpo.reward_weights": (2.0,), "grpo.loss_type": "grpo", "grpo.epsilon": 0.2,
        "grpo.epsilon_high": 0.28, "grpo.beta": 0.04, "grpo.scale_rewards": "none",
        "grpo.mask_truncated_completions": True}
    assert (o["data.format"], o["data.prompt_field"], o["data.chat_template"],
            o["data.files"]) == ("prompt", "prompt", "llama3", files["prompts"])
    assert (o["train.seq_len"], o["train.batch_size"], o["preference.reference"]) == (
        48 + 16, 4, "auto")
    assert "data.packing" not in o and "data.overlong" not in o
    reasons = {u.field: u.reason for u in conv.unmapped}
    assert "training mesh" in reasons["trl.use_vllm"], reasons
    assert "trl.vllm_server_port" in reasons and "trl.log_completions" in reasons
    assert_every_field_accounted_for(raw, conv)
    assert "c.grpo.reward_weights = (2.0,)" in check(conv)

    # Two functions joined; Axolotl's true scale_rewards is TRL's group; beta unset is
    # TRL's 0, no reference.
    # TRL's num_iterations (mu), where ndjax's GRPO has it.
    _, conv = grpo(files, {"reward_funcs": ["ndjax.rewards.math.accuracy",
                                            "ndjax.rewards.format.think_answer"],
                           "reward_weights": None, "scale_rewards": True, "beta": None,
                           "num_iterations": 2 if axolotl_grpo.ITERATIONS else 1})
    o = conv.overrides
    assert (o["grpo.reward_funcs"], o["grpo.scale_rewards"], o["grpo.beta"]) == (
        "ndjax.rewards.math.accuracy,ndjax.rewards.format.think_answer", "group", 0.0)
    assert "preference.reference" not in o
    assert o.get("grpo.num_iterations") == (2 if axolotl_grpo.ITERATIONS else None)
    check(conv)


def test_grpo_refusals_are_one_line_each_in_one_report(files):
    """Settings that change GRPO's sampling or loss beyond ndjax's, an Axolotl transform
    as the dataset's type, a batch num_generations does not divide: one line each,
    together."""
    with pytest.raises(ConfigError) as e:
        grpo(files, {"min_p": 0.05, "importance_sampling_level": "sequence",
                     "num_generations": 3, "max_completion_length": 64},
             datasets=[{"path": files["prompts"], "type": "rewards.prompt_transform"}])
    problems = e.value.conversion.problems
    expected = ["trl.min_p: 0.05 must be unset or 0",
                "trl.importance_sampling_level: 'sequence' must be token",
                "trl.num_generations: 3 does not divide the batch, 4 completions",
                "datasets[0].type: 'rewards.prompt_transform' is a transform Axolotl runs"]
    assert len(problems) == len(expected), "\n".join(problems)
    for start in expected:
        line = next((p for p in problems if p.startswith(start)), None)
        assert line is not None and "\n" not in line, (start, problems)
