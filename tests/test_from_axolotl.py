"""ndjax from_axolotl: Axolotl YAML configs (in the shape Axolotl's docs give:
docs/nd_parallelism.qmd, docs/dataset-formats/conversation.qmd) into ndjax config files
that build, every unmapped field listed; bad input is every problem in one report (with
the fields not mapped), exit 2, nothing written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest
import yaml
from conftest import tiny_config
from data_files import conversations, texts, write_chat_tokenizer, write_jsonl
from transformers import TrainingArguments

from ndjax.experiment import Experiment
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.verbs import from_axolotl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 384  # the chat tokenizer's 360 ids fit
MOE = dict(family="qwen3_moe", head_dim=16, n_experts=4, experts_per_token=2, moe_ffn_dim=32)

ND_YAML = """\
base_model: {hf}
datasets:
  - path: {text}
    type: completion
    field: body
  - path: mlabonne/FineTome-100k
    type: chat_template
  - path: {chats}
    type: alpaca
sequence_len: 64
sample_packing: true
fsdp_version: 2
fsdp_config:
  offload_params: false
  state_dict_type: FULL_STATE_DICT
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: LlamaDecoderLayer
  reshard_after_forward: true
dp_shard_size: 2
tensor_parallel_size: 2
context_parallel_size: 2
micro_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 200
learning_rate: 0.0002
lr_scheduler: linear
adapter: lora
lora_r: 16
lora_alpha: 32
flash_attention: true
bf16: true
output_dir: ./outputs/nd
seed: 7
"""

SFT_YAML = """\
base_model: {hf}
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: false
strict: false
chat_template: tokenizer_default
datasets:
  - path: {chats}
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: role
      content: content
    roles_to_train: ["assistant"]
    drop_system_message: true
test_datasets:
  - path: {eval_chats}
    type: chat_template
    field_messages: conversations
dataset_prepared_path: last_run_prepared
output_dir: ./outputs/sft
sequence_len: 96
sample_packing: false
micro_batch_size: 1
gradient_accumulation_steps: 2
max_steps: 50
num_epochs: 3
optimizer: adamw_torch_fused
lr_scheduler: cosine
learning_rate: 2e-5
train_on_inputs: false
fp16: false
warmup_ratio: 0.1
adam_beta2: 0.95
weight_decay: 0.01
gradient_checkpointing: true
eval_steps: 10
save_steps: 0.5
logging_steps: 5
wandb_project:
special_tokens:
  pad_token: <|end_of_text|>
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Hugging Face Llama directory with a chat tokenizer, chat and text files."""
    root = tmp_path_factory.mktemp("axolotl")
    tokenizer = write_chat_tokenizer(root / "tokenizer")
    exp = Experiment.from_config(tiny_config(model=dict(vocab_size=VOCAB)), jax.devices()[:1])
    zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), exp.param_shapes)
    hf.export(zeros, exp.model_cfg, str(root / "hf"), "float32")  # nothing compiled
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer.parent / name, root / "hf")
    for name, chats in (("chats.jsonl", conversations(40)), ("eval.jsonl", conversations(8, 1))):
        (root / name).write_text("".join(json.dumps({"conversations": c}) + "\n" for c in chats))
    write_jsonl(root / "text.jsonl", texts(40), field="body")
    # A mixture of experts (4 experts) for expert parallelism, in the same way.
    moe = Experiment.from_config(tiny_config(model=dict(vocab_size=VOCAB, **MOE)),
                                 jax.devices()[:1])
    zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), moe.param_shapes)
    hf.export(zeros, moe.model_cfg, str(root / "moe"), "float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer.parent / name, root / "moe")
    return {"hf": str(root / "hf"), "chats": str(root / "chats.jsonl"),
            "eval_chats": str(root / "eval.jsonl"), "text": str(root / "text.jsonl"),
            "moe": str(root / "moe"), "root": root}


def yaml_of(template: str, files: dict) -> dict:
    return yaml.safe_load(template.format(**files))


def build(conv: from_axolotl.Conversion):
    """The rendered file, checked as the CLI checks it, then built on 8 CPU devices."""
    text = from_axolotl.render(conv, "config.yml")
    from_axolotl.check(text, conv)
    config = from_axolotl.load(text)
    config.export.hf_dir = None  # the tests write no export
    return config, Experiment.from_config(config)


def assert_every_field_accounted_for(raw: dict, conv: from_axolotl.Conversion) -> None:
    """Each Axolotl key (top level and in each dataset) is named by a mapped setting's
    note or listed as unmapped: nothing is dropped silently."""
    unmapped = {u.field for u in conv.unmapped}
    notes = " ".join(conv.notes.values())
    for key in raw:
        listed = key in unmapped or any(u.startswith((f"{key}[", f"{key}.")) for u in unmapped)
        assert listed or re.search(rf"\b{key}\b", notes), key
    for group in ("datasets", "test_datasets"):
        for i, entry in enumerate(raw.get(group) or []):
            for key in entry:
                where = f"{group}[{i}]"
                assert where in unmapped or f"{where}.{key}" in unmapped or key in (
                    "path", "type", "field", "field_messages", "message_property_mappings",
                    "roles_to_train", "train_on_eos", "train_on_eot"), (where, key)


def test_nd_parallel_yaml_maps_the_mesh_and_builds(files):
    raw = yaml_of(ND_YAML, files)
    conv = from_axolotl.convert(raw)
    o = conv.overrides
    assert {a: o[f"mesh.{a}"] for a in ("replica", "fsdp", "expert", "context", "tensor")} == \
        dict(replica=1, fsdp=2, expert=1, context=2, tensor=2)
    # Axolotl's global batch: micro_batch_size x accumulation x dp_replicate x dp_shard.
    assert (o["train.batch_size"], o["train.grad_accum"]) == (2 * 2 * 2, 2)
    # Axolotl's completion type, as Axolotl tokenizes it (ndjax.data.prompt_formats).
    assert (o["data.source"], o["data.format"], o["data.files"], o["data.text_field"]) == (
        "chat", "completion", files["text"], "body")
    assert o["data.packing"] is True and o["model.dtype"] == "bfloat16"
    assert (o["train.steps"], o["train.lr"], o["train.seed"]) == (200, 2e-4, 7)
    assert o["train.warmup_steps"] == 6  # Axolotl's default: 3% of the steps
    assert o["train.schedule"] == "linear" and "train.min_lr_ratio" not in o
    # Axolotl's defaults where ndjax's differ.
    assert (o["train.weight_decay"], o["train.b2"]) == (0.0, 0.999)
    assert conv.workdir == "./outputs/nd"
    reasons = {u.field: u.reason for u in conv.unmapped}
    assert set(reasons) >= {"datasets[1]", "datasets[2]", "fsdp_version", "fsdp_config",
                            "flash_attention"}, reasons
    assert "lr_scheduler" not in reasons  # linear is ndjax's train.schedule=linear
    # A hub chat_template dataset and an alpaca one are other kinds than the first.
    assert all("one kind of dataset per run" in reasons[f"datasets[{i}]"] for i in (1, 2))
    # adapter: lora -> model.lora, on PEFT's default targets; the adapter is the output.
    assert {k: o[f"model.lora.{k}"] for k in ("rank", "alpha", "target_modules")} == dict(
        rank=16, alpha=32.0, target_modules="q_proj,v_proj")
    assert o["export.adapter_dir"] == "./outputs/nd/adapter" and "export.hf_dir" not in o
    assert_every_field_accounted_for(raw, conv)

    config, exp = build(conv)
    assert dict(exp.mesh.shape) == {"stage": 1, "replica": 1, "fsdp": 2, "expert": 1,
                                    "context": 2, "tensor": 2}
    assert exp.model_cfg.family == "llama" and exp.model_cfg.vocab_size == VOCAB
    assert config.model.init_from == files["hf"]
    assert (exp.model_cfg.lora.rank, exp.model_cfg.lora.targets) == (16, ("q", "v"))


def test_qlora_and_the_adapter_fields_ndjax_lacks_are_listed(files):
    """QLoRA is LoRA on an NF4 base, load_in_8bit on an int8 one; lora_target_linear is
    all-linear; lora_model_dir is model.lora.init_from; bitsandbytes' options are listed,
    not dropped."""
    raw = {**yaml_of(SFT_YAML, files), "adapter": "qlora", "load_in_4bit": True, "lora_r": 32,
           "lora_target_linear": True, "lora_target_modules": ["q_proj"], "lora_dropout": 0.05,
           "peft_use_rslora": True, "lora_model_dir": "runs/old",
           "bnb_4bit_use_double_quant": True}
    raw.pop("load_in_8bit")
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert (o["model.lora.rank"], o["model.lora.alpha"], o["model.lora.target_modules"],
            o["model.lora.use_rslora"], o["model.lora.quantize"], o["model.lora.dropout"]) == (
        32, 8.0, "all-linear", True, "nf4", 0.05)
    reasons = {u.field: u.reason for u in conv.unmapped}
    assert "adapter" not in reasons and "load_in_4bit" not in reasons
    assert "double quantization" in reasons["bnb_4bit_use_double_quant"]
    assert "lora_dropout" not in reasons and "lora_model_dir" not in reasons
    assert o["model.lora.init_from"] == "runs/old"
    eight = from_axolotl.convert({**raw, "adapter": "lora", "load_in_4bit": False,
                                  "load_in_8bit": True}, devices=8)
    assert eight.overrides["model.lora.quantize"] == "int8"
    with pytest.raises(ConfigError, match="load_in_8bit: .* must be false when load_in_4bit"):
        from_axolotl.convert({**raw, "load_in_8bit": True}, devices=8)
    assert_every_field_accounted_for(raw, conv)
    plain = from_axolotl.convert({**raw, "adapter": "lora", "load_in_4bit": False}, devices=8)
    with pytest.raises(ConfigError, match=r"model.lora.init_from='runs/old' is not a local "
                       r"directory.* \(model.lora.init_from from lora_model_dir\)$"):
        from_axolotl.check(from_axolotl.render(plain, "config.yml"), plain)
    conv = from_axolotl.convert({**raw, "lora_target_linear": False,
                                 "lora_target_modules": ["q_proj", "w_q"]}, devices=8)
    with pytest.raises(ConfigError, match=r"model.lora.target_modules='q_proj,w_q': 'w_q' is no "
                       r"module .* \(model.lora.target_modules from lora_target_modules\)"):
        from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)


def test_sft_yaml_with_chat_template_datasets(files):
    raw = yaml_of(SFT_YAML, files)
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert (o["mesh.fsdp"], o["mesh.replica"]) == (8, 1)  # dp_shard_size: Axolotl's inference
    assert (o["train.batch_size"], o["train.grad_accum"]) == (1 * 2 * 8, 2)
    assert (o["data.source"], o["data.files"], o["data.eval_files"]) == (
        "chat", files["chats"], files["eval_chats"])
    assert (o["data.messages_field"], o["data.chat_template"]) == ("conversations", "")
    assert o["data.tokenizer"] == os.path.join(files["hf"], "tokenizer.json")
    assert o["data.packing"] is False and o["model.remat"] == "full"
    assert o["train.lr"] == 2e-5  # YAML reads 2e-5 as a string; Axolotl takes it
    assert (o["train.b2"], o["train.weight_decay"]) == (0.95, 0.01)
    assert o["train.warmup_steps"] == 5  # warmup_ratio x max_steps
    # lr_scheduler: cosine without cosine_min_lr_ratio is transformers' cosine, down to 0.
    assert (o["train.schedule"], o["train.min_lr_ratio"]) == ("cosine", 0.0)
    assert (o["train.eval_every"], o["checkpoint.every"], o["log.every"]) == (10, 25, 5)
    assert o["export.hf_dir"] == os.path.join("./outputs/sft", "hf")
    unmapped = {u.field: u for u in conv.unmapped}
    assert set(unmapped) == {"model_type", "tokenizer_type", "load_in_8bit", "strict",
                             "datasets[0].drop_system_message", "dataset_prepared_path",
                             "num_epochs", "train_on_inputs", "fp16", "wandb_project"}, unmapped
    # pad_token: a token the tokenizer has, so nothing grows (tests/test_added_tokens.py).
    assert (o["data.pad_token"], o["data.added_special_tokens"]) == (
        "<|end_of_text|>", ("<|end_of_text|>",))
    for off in ("load_in_8bit", "train_on_inputs", "fp16", "wandb_project"):
        assert unmapped[off].reason == "off, nothing to map", unmapped[off]
    # Listed in the YAML's order.
    assert [u.field for u in conv.unmapped][:3] == ["model_type", "tokenizer_type",
                                                    "load_in_8bit"]
    assert_every_field_accounted_for(raw, conv)

    _, exp = build(conv)
    assert dict(exp.mesh.shape) == {"stage": 1, "replica": 1, "fsdp": 8, "expert": 1,
                                    "context": 1, "tensor": 1}
    assert exp.settings.train.eval_every == 10 and exp.settings.data.source == "chat"


def test_num_epochs_is_a_length_in_epochs_with_evals_and_saves_per_epoch(files):
    # Axolotl's usual length (225 of its 245 dataset examples): ndjax counts the steps
    # from the rows an epoch packs into (train.epochs), and what is counted per epoch
    # with it; the converted config passes ndjax's checks and builds.
    raw = {**yaml_of(SFT_YAML, files), "max_steps": None, "num_epochs": 2, "eval_steps": None,
           "save_steps": None, "saves_per_epoch": 4}
    raw = {k: v for k, v in raw.items() if v is not None}
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert "train.steps" not in o and o["train.epochs"] == 2.0
    assert o["train.warmup_ratio"] == 0.1 and "train.warmup_steps" not in o
    assert o["train.evals_per_epoch"] == 1  # Axolotl's default: once an epoch
    assert o["checkpoint.saves_per_epoch"] == 4 and "checkpoint.every" not in o
    assert_every_field_accounted_for(raw, conv)
    config, exp = build(conv)
    assert exp.settings.train.epochs == 2.0


def test_val_set_size_holds_out_a_share_of_the_dataset(files):
    raw = {k: v for k, v in yaml_of(SFT_YAML, files).items() if k != "test_datasets"}
    raw["val_set_size"] = 0.1
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert o["data.eval_fraction"] == 0.1 and "data.eval_files" not in o
    assert o["train.eval_every"] == 10  # eval_steps
    assert_every_field_accounted_for(raw, conv)
    config, exp = build(conv)
    assert exp.settings.data.eval_fraction == 0.1


@pytest.mark.parametrize("change, message", [
    ({"max_steps": None, "num_epochs": 2}, "save_steps: 0.5 must be a whole number of steps "
     "when num_epochs sets the length"),
    ({"dp_shard_size": 3}, "--devices=8: expert_parallel_size 1 x dp_replicate_size 2 x "
     "dp_shard_size 3 x context_parallel_size 1 x tensor_parallel_size 1 is 6 GPUs"),
    ({"warmup_steps": 3}, "warmup_steps: 3 and warmup_ratio: 0.1 are both set"),
    ({"warmup_ratio": None, "warmup_steps": 2.5},
     "warmup_steps: 2.5 must be a whole number of steps >= 0, or a fraction of max_steps "
     "below 1"),
    ({"warmup_ratio": None, "warmup_steps": "0.1"}, "warmup_steps: '0.1' must be a whole "
     "number of steps >= 0, or a fraction of max_steps below 1 (transformers' rule); e.g. "
     "warmup_steps: 10, or warmup_steps: 0.1 for a tenth of the steps, without quotes"),
    ({"lr_scheduler": "cosine_decay"}, "lr_scheduler: 'cosine_decay' must be one of "
     "transformers' schedulers (linear, cosine, "),
    ({"lr_scheduler": "cosine_with_min_lr", "cosine_min_lr_ratio": 0.1},
     "lr_scheduler: 'cosine_with_min_lr' needs lr_scheduler_kwargs' min_lr_rate or min_lr"),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-4}},
     "lr_scheduler_kwargs: min_lr 0.0001 / learning_rate is 5, a floor above learning_rate"),
    ({"expert_parallel_size": 2}, "expert_parallel_size: 2: base_model is a dense llama, "
     "with no experts to split; set expert_parallel_size: 1"),
    ({"expert_parallel_size": 3}, "expert_parallel_size: 3 does not divide --devices=8"),
    ({"sample_packing": "yes"}, "sample_packing: 'yes' must be true or false"),
    ({"adapter": "dora"}, "adapter: 'dora' must be lora or qlora"),
    ({"adapter": "lora", "lora_r": 0}, "lora_r: 0 must be a whole number >= 1"),
    ({"adapter": "lora", "lora_target_modules": ".*_proj"},
     "lora_target_modules: '.*_proj' must be a module name such as q_proj"),
    ({"datasets": [{"path": "missing.jsonl", "type": "chat_template"}]},
     "datasets[0].path: 'missing.jsonl' is not a file or directory"),
    ({"wandb_project": "p", "wandb_mode": "dryrun"},
     "wandb_mode: 'dryrun' must be online, offline or disabled; W&B knows no other mode"),
    ({"use_mlflow": "yes"}, "use_mlflow: 'yes' must be true or false"),
])
def test_bad_values_name_the_field(files, change, message):
    raw = {**yaml_of(SFT_YAML, files), **change}
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_axolotl.convert(raw, devices=8)


TRACKERS = {"wandb_project": "sft", "wandb_entity": "team", "wandb_name": "llama-sft",
            "wandb_run_id": "sft-1", "wandb_mode": "offline", "wandb_watch": "gradients",
            "wandb_log_model": "checkpoint", "use_mlflow": True,
            "mlflow_tracking_uri": "http://localhost:5000", "mlflow_experiment_name": "sft",
            "mlflow_run_name": "llama-sft", "hf_mlflow_log_artifacts": True}


def test_wandb_and_mlflow_fields_map_to_the_log_settings(files):
    raw = {**yaml_of(SFT_YAML, files), **TRACKERS}
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert {k: v for k, v in o.items() if k.startswith(("log.wandb", "log.mlflow"))} == {
        "log.wandb_project": "sft", "log.wandb_entity": "team", "log.wandb_name": "llama-sft",
        "log.wandb_run_id": "sft-1", "log.wandb_mode": "offline",
        "log.mlflow_tracking_uri": "http://localhost:5000", "log.mlflow_experiment": "sft",
        "log.mlflow_run_name": "llama-sft"}
    unmapped = {u.field: u.reason for u in conv.unmapped}
    assert unmapped["wandb_watch"] == unmapped["wandb_log_model"] == (
        "ndjax logs the settings and metrics to W&B, not models or gradients")
    assert unmapped["hf_mlflow_log_artifacts"].startswith("ndjax logs the settings and "
                                                          "metrics to MLflow")
    assert not {k for k in TRACKERS if k in unmapped} - {"wandb_watch", "wandb_log_model",
                                                         "hf_mlflow_log_artifacts"}
    assert_every_field_accounted_for(raw, conv)
    from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)  # ndjax takes them
    # A run id W&B refuses: ndjax's checks of the converted file name the Axolotl field.
    conv = from_axolotl.convert({**raw, "wandb_run_id": "team/run"}, devices=8)
    with pytest.raises(ConfigError, match=r"^the converted config fails ndjax's checks: "
                       r"log.wandb_run_id='team/run': .* \(log.wandb_run_id from "
                       r"wandb_run_id\)$"):
        from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)


@pytest.mark.parametrize("change, overrides, listed", [
    # As in Axolotl: W&B is on with wandb_project, MLflow with use_mlflow or an experiment.
    ({"use_wandb": True, "wandb_entity": "team"}, {},
     {"use_wandb": "W&B is off: Axolotl turns it on with wandb_project",
      "wandb_entity": "W&B is off: Axolotl turns it on with wandb_project"}),
    ({"wandb_project": "sft", "use_wandb": False}, {"log.wandb_project": "sft"}, {}),
    ({"mlflow_tracking_uri": "http://localhost:5000"}, {}, {"mlflow_tracking_uri": "MLflow is "
     "off: Axolotl turns it on with use_mlflow or mlflow_experiment_name"}),
    ({"use_mlflow": True}, {"log.mlflow_tracking_uri": "./mlruns"}, {}),
    ({"mlflow_experiment_name": "sft"},
     {"log.mlflow_tracking_uri": "./mlruns", "log.mlflow_experiment": "sft"}, {}),
    ({"use_mlflow": False, "wandb_project": ""}, {},
     {"use_mlflow": "off, nothing to map", "wandb_project": "off, nothing to map"}),
])
def test_trackers_are_on_as_axolotl_turns_them_on(files, change, overrides, listed):
    raw = {**yaml_of(SFT_YAML, files), **change}
    conv = from_axolotl.convert(raw, devices=8)
    assert {k: v for k, v in conv.overrides.items()
            if k.startswith(("log.wandb", "log.mlflow"))} == overrides
    unmapped = {u.field: u.reason for u in conv.unmapped}
    assert {k: unmapped[k] for k in listed} == listed
    assert_every_field_accounted_for(raw, conv)


@pytest.mark.parametrize("base, overrides, coef, listed", [
    ("mixtral", {"model_config": {"output_router_logits": True}}, 0.02, set()),
    ("mixtral", {"overrides_of_model_config": {"output_router_logits": True,
                                               "router_aux_loss_coef": 0.01, "rope_theta": 1}},
     0.01, {"overrides_of_model_config.rope_theta"}),
    ("mixtral", {"overrides_of_model_config": {"router_aux_loss_coef": 0.01}}, 0.0, set()),
    ("llama", {"overrides_of_model_config": {"output_router_logits": True}}, None,
     {"overrides_of_model_config.output_router_logits"}),
], ids=["on_base_weight", "on_own_weight", "weight_only", "dense"])
def test_output_router_logits_sets_the_aux_loss_weight(files, tmp_path, base, overrides, coef,
                                                       listed):
    """output_router_logits and router_aux_loss_coef in overrides_of_model_config (or its
    alias model_config) set model.router_aux_loss_coef as transformers weighs the
    load-balancing loss: the weight (the YAML's, else base_model's) where
    output_router_logits is true, else 0; base_model's config.json stays the model. A
    dense base_model has no router: listed, as are the overrides' other keys."""
    base_dir = files["hf"]
    if base == "mixtral":  # only config.json is read: a Mixtral's, released as 8x7B's
        base_dir = tmp_path / "mixtral"
        shutil.copytree(files["hf"], base_dir)
        (base_dir / "config.json").write_text(json.dumps(
            {"model_type": "mixtral", "output_router_logits": False,
             "router_aux_loss_coef": 0.02}))
    raw = {**yaml_of(SFT_YAML, {**files, "hf": str(base_dir)}), **overrides}
    conv = from_axolotl.convert(raw, devices=8)
    assert conv.overrides.get("model.router_aux_loss_coef") == coef
    assert {u.field for u in conv.unmapped} & {f"{k}.{x}" for k, v in overrides.items()
                                               for x in v} == listed
    assert_every_field_accounted_for(raw, conv)


def test_chat_templates(files, tmp_path):
    """A template file is data.chat_template, and so is a named template ndjax ships (by
    its name); Axolotl's other named templates and inline Jinja are listed, and the
    tokenizer's own is used."""
    jinja = tmp_path / "template.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    sft = yaml_of(SFT_YAML, files)
    for change, template, listed in [
            ({"chat_template": "jinja", "chat_template_jinja": str(jinja)}, str(jinja), set()),
            ({"chat_template": "chatml"}, "chatml", set()),
            ({"chat_template": "qwen3"}, "qwen3", set()),
            ({"chat_template": "phi_3"}, "", {"chat_template"}),
            ({"chat_template": None, "chat_template_jinja": "{{ messages }}"}, "",
             {"chat_template_jinja"}),
            ({"chat_template_jinja": "{{ messages }}"}, "", {"chat_template_jinja"})]:
        conv = from_axolotl.convert({**sft, **change}, devices=8)
        assert conv.overrides["data.chat_template"] == template, change
        assert {u.field for u in conv.unmapped} & {"chat_template", "chat_template_jinja"} == \
            listed, change


def test_unmapped_named_templates_say_which_ndjax_ships(files):
    conv = from_axolotl.convert({**yaml_of(SFT_YAML, files), "chat_template": "phi_3"},
                                devices=8)
    reason, = [u.reason for u in conv.unmapped if u.field == "chat_template"]
    assert "ndjax ships chatml, gemma3, llama3, qwen3" in reason


@pytest.mark.parametrize("entry, settings, listed", [
    ({}, {}, set()),
    ({"roles_to_train": ["assistant"], "train_on_eos": "turn"}, {}, set()),
    ({"roles_to_train": ["human", "gpt"], "train_on_eos": "all"},
     {"data.roles_to_train": "user,assistant", "data.train_on_eos": "all"}, set()),
    ({"roles_to_train": ["assistant"], "train_on_eos": "last"},
     {"data.train_on_eos": "last"}, set()),
    ({"train_on_eot": "none"}, {"data.train_on_eos": "none"}, set()),
    ({"train_on_eos": "all", "train_on_eot": "turn"}, {}, {"datasets[0].train_on_eos"}),
    ({"roles_to_train": ["narrator"]}, {}, {"datasets[0].roles_to_train"}),
    ({"roles_to_train": []}, {}, {"datasets[0].roles_to_train"}),
    ({"train_on_eos": "sometimes"}, {}, {"datasets[0].train_on_eos"}),
])
def test_roles_to_train_and_train_on_eos(files, entry, settings, listed):
    # Axolotl's defaults (["assistant"], turn) are ndjax's: only other values are written.
    raw = yaml_of(SFT_YAML, files)
    dataset = {k: v for k, v in raw["datasets"][0].items() if k != "roles_to_train"}
    raw["datasets"] = [{**dataset, **entry}]
    conv = from_axolotl.convert(raw, devices=8)
    got = {k: v for k, v in conv.overrides.items()
           if k in ("data.roles_to_train", "data.train_on_eos")}
    assert got == settings
    assert {u.field for u in conv.unmapped} & {f"datasets[0].{k}" for k in (
        "roles_to_train", "train_on_eos", "train_on_eot")} == listed
    assert_every_field_accounted_for(raw, conv)
    from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)


def test_a_value_ndjax_refuses_fails_at_conversion_naming_its_axolotl_field(files):
    """The converter loads what it wrote and runs ndjax's checks, so a value ndjax
    refuses (a seed beyond 32 bits) fails there, not at train time."""
    conv = from_axolotl.convert({**yaml_of(SFT_YAML, files), "seed": 2**33}, devices=8)
    with pytest.raises(ConfigError, match=r"train\.seed=8589934592 .* \(train\.seed from seed\)"):
        from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)


def test_every_check_of_the_converted_config_that_fails_is_reported(files, tmp_path):
    """ndjax's checks of the converted file go on past one that fails where the next does
    not need its result: an export directory that exists and a token LoRA cannot train
    are both reported, each with its Axolotl fields."""
    (tmp_path / "out" / "adapter").mkdir(parents=True)
    (tmp_path / "out" / "adapter" / "adapter_config.json").write_text("{}")
    raw = {**yaml_of(SFT_YAML, files), "output_dir": str(tmp_path / "out"), "adapter": "lora",
           "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True,
           "special_tokens": {"pad_token": "<|not_in_vocab|>"}}
    conv = from_axolotl.convert(raw, devices=8)
    with pytest.raises(ConfigError) as e:
        from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert re.search(r"export.adapter_dir=.* exists .*\(export.adapter_dir from "
                     r"output_dir", lines[0]), lines[0]
    assert re.search(r"give 1 new token id\(s\) .*\(data.added_special_tokens from "
                     r"special_tokens", lines[1]), lines[1]


def transformers_warmup(warmup_steps: float, steps: int) -> int:
    """The warmup steps transformers runs for a warmup_steps Axolotl hands it."""
    return TrainingArguments(output_dir="unused", warmup_steps=warmup_steps,
                             report_to=[]).get_warmup_steps(steps)


@pytest.mark.parametrize("value, steps, warmup", [(0.1, 45, 5), (0.01, 50, 1), (0.5, 7, 4),
                                                  (12, 50, 12)])
def test_warmup_steps_below_1_is_a_fraction_of_the_steps_as_in_transformers(files, value,
                                                                            steps, warmup):
    """Axolotl passes warmup_steps to transformers as it is, which reads a value below 1
    as that fraction of the steps, rounded up (0.1 of 45 steps: 5, not 4; 0.01 of 50: 1,
    which Axolotl's "1 becomes 2" never sees)."""
    raw = {**yaml_of(SFT_YAML, files), "warmup_ratio": None, "warmup_steps": value,
           "max_steps": steps}
    conv = from_axolotl.convert(raw, devices=8)
    assert conv.overrides["train.warmup_steps"] == warmup == transformers_warmup(value, steps)
    assert "warmup_steps" in conv.notes["train.warmup_steps"]


def test_warmup_steps_0_beside_a_ratio_wins_as_in_axolotl(files):
    """Axolotl refuses warmup_steps with warmup_ratio only when both are non-zero, and
    then reads warmup_steps."""
    raw = {**yaml_of(SFT_YAML, files), "warmup_steps": 0}
    conv = from_axolotl.convert(raw, devices=8)
    assert conv.overrides["train.warmup_steps"] == 0
    assert "warmup_steps is set" in {u.field: u.reason for u in conv.unmapped}["warmup_ratio"]
    assert_every_field_accounted_for(raw, conv)


@pytest.mark.parametrize("change, schedule, min_lr_ratio, listed", [
    ({"lr_scheduler": "linear"}, "linear", None, {}),
    ({"lr_scheduler": "linear", "cosine_min_lr_ratio": 0.1}, "linear", None,
     {"cosine_min_lr_ratio": "Axolotl reads it only with lr_scheduler: cosine"}),
    ({"lr_scheduler": "cosine"}, "cosine", 0.0, {}),
    ({"cosine_min_lr_ratio": 0, "lr_quadratic_warmup": False,
      "lr_scheduler_kwargs": {"num_cycles": 0.5}}, "cosine", 0.0, {}),
    ({"lr_scheduler": None, "cosine_min_lr_ratio": 0.1}, "cosine", 0.1, {}),
    ({"cosine_min_lr_ratio": 0.1, "cosine_constant_lr_ratio": 0.8}, "cosine", 0.1,
     {"cosine_constant_lr_ratio": "ndjax's cosine decays over the whole run"}),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.2}},
     "cosine", 0.2, {}),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 4e-6},
      "cosine_min_lr_ratio": 0.5}, "cosine", pytest.approx(0.2),
     {"cosine_min_lr_ratio": "cosine_with_min_lr's floor is lr_scheduler_kwargs.min_lr_rate"}),
    ({"lr_scheduler": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1.5}}, "cosine", 0.0,
     {"lr_scheduler_kwargs.num_cycles": "ndjax's cosine goes down once"}),
    ({"lr_scheduler": "constant_with_warmup"}, "constant", None, {}),
    ({"lr_scheduler": "cosine_with_restarts"}, "cosine", 0.0,
     {"lr_scheduler": "the config uses cosine, Axolotl's default"}),
    ({"lr_scheduler": "one_cycle"}, "cosine", 0.0,
     {"lr_scheduler": "ndjax's schedules are cosine (to a floor), linear and constant"}),
    ({"lr_scheduler": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}}, "cosine", 0.0,
     {"lr_scheduler": "the config uses cosine",
      "lr_scheduler_kwargs.power": "ndjax's cosine schedule has no such argument"}),
], ids=["linear", "linear_floor", "cosine", "cosine_defaults", "cosine_floor", "cosine_constant",
        "min_lr_rate", "min_lr", "cycles", "constant_with_warmup", "restarts", "one_cycle",
        "polynomial"])
def test_lr_scheduler_is_mapped_or_listed(files, change, schedule, min_lr_ratio, listed):
    """Each lr_scheduler as Axolotl runs it: linear, cosine (to 0, or Axolotl's own to
    lr x cosine_min_lr_ratio), transformers' cosine_with_min_lr (its floor from
    lr_scheduler_kwargs) and constant_with_warmup are ndjax schedules
    (tests/test_schedule.py compares them with transformers'); a scheduler, ratio or
    argument ndjax lacks is listed with the reason, never dropped."""
    raw = {**yaml_of(SFT_YAML, files), **change}
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert (o["train.schedule"], o["train.warmup_steps"]) == (schedule, 5)  # 0.1 x 50
    assert o.get("train.min_lr_ratio") == min_lr_ratio
    reasons = {u.field: u.reason for u in conv.unmapped}
    for field, why in listed.items():
        assert why in reasons.get(field, ""), (field, reasons)
    assert not {"lr_scheduler", "cosine_min_lr_ratio", "cosine_constant_lr_ratio"} & (
        set(reasons) - set(listed)), reasons
    assert_every_field_accounted_for(raw, conv)


def test_expert_parallel_comes_on_top_of_dp_shard_as_in_axolotl(files):
    """Axolotl's expert_parallel_size x dp_shard_size (x the other sizes) is its world
    size, each expert-parallel rank reading its own micro-batches: mesh.expert beside
    mesh.fsdp, as many GPUs, the same global batch."""
    raw = {**yaml_of(SFT_YAML, {**files, "hf": files["moe"]}), "expert_parallel_size": 2}
    docs = from_axolotl.convert({**raw, "dp_shard_size": 2}).overrides  # Axolotl's example
    assert {a: docs[f"mesh.{a}"] for a in ("replica", "fsdp", "expert", "context", "tensor")} \
        == dict(replica=1, fsdp=2, expert=2, context=1, tensor=1)
    assert (docs["runtime.cpu_devices"], docs["train.batch_size"]) == (4, 1 * 2 * 4)
    # Unset, dp_shard_size is what the experts leave of --devices.
    conv = from_axolotl.convert(raw, devices=8)
    o = conv.overrides
    assert (o["mesh.fsdp"], o["mesh.expert"], o["runtime.cpu_devices"]) == (4, 2, 8)
    assert o["train.batch_size"] == 1 * 2 * 8
    assert "inferred as Axolotl does from --devices=8" in conv.notes["mesh.fsdp"]
    _, exp = build(conv)
    assert dict(exp.mesh.shape) == {"stage": 1, "replica": 1, "fsdp": 4, "expert": 2,
                                    "context": 1, "tensor": 1}
    with pytest.raises(ConfigError, match=re.escape(
            "expert_parallel_size: 3 does not divide base_model's 4 experts")):
        from_axolotl.convert({**raw, "expert_parallel_size": 3}, devices=6)
    with pytest.raises(ConfigError, match=re.escape(
            "expert_parallel_size: 4 does not divide --devices=6")):
        from_axolotl.convert({**raw, "expert_parallel_size": 4}, devices=6)


def cli(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "ndjax", "from_axolotl", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_the_config_and_lists_what_it_left_out(files):
    root = files["root"]
    (root / "nd.yml").write_text(ND_YAML.format(**files))
    out = root / "nd_config.py"
    result = cli(str(root / "nd.yml"), f"--out={out}")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "ndjax from_axolotl: not mapped: flash_attention: true (ndjax picks its attention " \
           "kernel and packing itself (model.attn_impl=auto))" in lines, lines
    assert lines[-1].endswith(f"train with: python train.py --config={out} "
                              "--workdir=./outputs/nd"), lines
    assert not result.stdout and "Traceback" not in result.stderr
    assert "#   flash_attention: true (" in out.read_text()  # the file lists them too
    assert "c.model.lora.rank = 16  # lora_r" in out.read_text()
    # Another conversion does not replace it, unless asked to.
    before = out.read_text()
    refused = cli(str(root / "nd.yml"), f"--out={out}")
    assert refused.returncode == 2 and out.read_text() == before
    assert refused.stderr.strip() == f"ndjax from_axolotl: error: --out={out} exists; pass " \
                                     "--force to overwrite it."
    out.write_text("stale")
    assert cli(str(root / "nd.yml"), f"--out={out}", "--force").returncode == 0
    assert out.read_text() == before


@pytest.mark.parametrize("case, text, message", [
    ("not_yaml", "base_model: [unclosed\n", "is not valid YAML at line 2"),
    ("not_a_mapping", "- base_model\n", "holds a list, not a mapping of Axolotl fields"),
])
def test_a_file_that_is_no_config_is_one_line_exit_2_and_nothing_written(tmp_path, case, text,
                                                                         message):
    config, out = tmp_path / f"{case}.yml", tmp_path / "out.py"
    config.write_text(text)
    result = cli(str(config), f"--out={out}")
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("ndjax from_axolotl: error: ") and message in result.stderr
    assert not out.exists() and not result.stdout


REPORT_YAML = """\
base_model: {hf}
datasets:
  - path: {chats}
    type: chat_template
    field_messages: conversations
  - path: missing.jsonl
    type: chat_template
dp_shard_size: 1
micro_batch_size: two
max_steps: 20
warmup_steps: 2.5
lr_scheduler: cosine_with_min_lr
flash_attention: true
adapter: dora
"""


def test_every_problem_is_in_one_report_with_the_fields_not_mapped(files, tmp_path):
    """Each field the converter cannot take and each check that fails is a line of its
    own, after the fields not mapped, then a count: exit 2, nothing written."""
    config, out = tmp_path / "many.yml", tmp_path / "out.py"
    config.write_text(REPORT_YAML.format(**files))
    result = cli(str(config), f"--out={out}")
    assert result.returncode == 2 and not out.exists() and not result.stdout, result.stderr
    lines = result.stderr.splitlines()
    assert all(line.startswith("ndjax from_axolotl: ") for line in lines), lines
    assert lines[0] == "ndjax from_axolotl: not mapped: flash_attention: true (ndjax picks " \
                       "its attention kernel and packing itself (model.attn_impl=auto))", lines
    errors = [line.removeprefix("ndjax from_axolotl: error: ") for line in lines[1:-1]]
    expected = ["micro_batch_size: 'two' must be a whole number >= 1; write it without quotes",
                "learning_rate is not set; Axolotl needs it too.",
                "warmup_steps: 2.5 must be a whole number of steps >= 0",
                "lr_scheduler: 'cosine_with_min_lr' needs lr_scheduler_kwargs' min_lr_rate",
                "datasets[1].path: 'missing.jsonl' is not a file or directory",
                "adapter: 'dora' must be lora or qlora"]
    assert len(errors) == len(expected) and all(
        e.startswith(x) for e, x in zip(errors, expected)), errors
    assert lines[-1] == "ndjax from_axolotl: 6 problems (the error lines), 1 field not mapped; " \
                        "nothing written.", lines
    # The same in-process: ConversionError holds every problem and the fields not mapped.
    with pytest.raises(from_axolotl.ConversionError) as e:
        from_axolotl.convert(yaml.safe_load(config.read_text()))
    assert e.value.conversion.problems == errors
    assert [u.field for u in e.value.conversion.unmapped] == ["flash_attention"]


@pytest.mark.parametrize("case, change, message, listed", [
    ("none_readable", {"datasets": [{"path": "{chats}", "type": "pygmalion"},
                                    {"path": "{chats}", "type": "alpaca:phi"}]},
     "datasets: none of them is a dataset ndjax reads (each is listed as not mapped)",
     ["datasets[0]: ", "datasets[1]: "]),
    ("ndjax_check", {"seed": 2**33}, "the converted config fails ndjax's checks: "
     "train.seed=8589934592", ["model_type: 'AutoModelForCausalLM'"]),
    # Only the layout refuses it (8 simulated CPU devices, as the converted mesh has).
    ("layout", {"context_parallel_size": 8, "dp_shard_size": 1, "sequence_len": 100},
     "the converted config fails ndjax's checks: train.seq_len=100 is not divisible by 8 "
     "= context(8)", []),
    ("hub_dataset", {"datasets": [{"path": "org/data", "type": "chat_template"}]},
     "`hf download org/data --repo-type dataset`", []),
    ("hub_model", {"base_model": "meta-llama/Llama-3.2-1B"},
     "`hf download meta-llama/Llama-3.2-1B --local-dir DIR`", []),
])
def test_one_problem_comes_with_the_fields_not_mapped(files, tmp_path, case, change, message,
                                                      listed):
    """The datasets ndjax cannot read, which the error points to, are listed above it;
    a value that only ndjax's checks of the converted file refuse is reported the same
    way."""
    raw = {**yaml_of(SFT_YAML, files), **json.loads(json.dumps(change).replace(
        "{chats}", files["chats"]))}
    config, out = tmp_path / f"{case}.yml", tmp_path / "out.py"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = cli(str(config), f"--out={out}", "--devices=8")
    assert result.returncode == 2 and not out.exists() and not result.stdout, result.stderr
    lines = result.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("ndjax from_axolotl: error: ")]
    assert len(errors) == 1 and message in lines[errors[0]], lines
    assert errors[0] == len(lines) - 2 and "1 problem (the error lines)" in lines[-1], lines
    for field in listed:
        assert any(line.startswith(f"ndjax from_axolotl: not mapped: {field}")
                   for line in lines[:errors[0]]), (field, lines)


def test_help_is_short():
    result = cli("--help")
    assert result.returncode == 0 and len(result.stdout.splitlines()) < 40, result.stdout
    for flag in ("--out", "--force", "--devices", "config"):
        assert flag in result.stdout
