"""The typed config: every field set from the command line, every field's bad value
one clear error (in-process for all fields; through train.py for a sample)."""

import re
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from ndjax.config import RENAMED, Settings, default_config, field_paths, over_defaults
from ndjax.runtime.errors import ConfigError

# A valid value other than the default, for every field, written as on a command line.
GOOD = {
    "model.preset": "llama3_1b", "model.vocab_size": "512", "model.dim": "128",
    "model.n_layers": "3", "model.n_heads": "4", "model.n_kv_heads": "2",
    "model.ffn_dim": "256", "model.head_dim": "32", "model.rope_theta": "10000.0",
    "model.rope_scaling": "{'factor': 4.0}", "model.rms_norm_eps": "1e-6",
    "model.tie_embeddings": "True", "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
    "model.scan_layers": "False", "model.remat": "full", "model.pipeline_gather_once": "True",
    "model.attn_impl": "tiled",
    "model.cp_layout": "contiguous", "model.cp_impl": "all_to_all", "model.attn_kv_tile": "128",
    "model.attn_max_docs": "8",
    "model.init_from": "/nowhere/llama", "model.family": "qwen3", "model.qkv_bias": "True",
    "model.qk_norm": "True", "model.sliding_window": "64", "model.sliding_window_pattern": "6",
    "model.query_pre_attn_scalar": "64.0", "model.local_rope_theta": "10000.0",
    "model.n_experts": "8", "model.experts_per_token": "2", "model.moe_ffn_dim": "64",
    "model.norm_topk_prob": "True", "model.router_aux_loss_coef": "0.01",
    "model.shared_expert_dim": "128", "model.swiglu_limit": "7.0", "model.swiglu_alpha": "1.7",
    "model.q_lora_rank": "64", "model.kv_lora_rank": "64", "model.rope_head_dim": "16",
    "model.v_head_dim": "32", "model.rope_interleave": "True", "model.first_k_dense": "1",
    "model.n_group": "4", "model.topk_group": "2", "model.routed_scaling_factor": "2.5",
    "model.score_bias_rate": "0.01",
    "model.router_z_loss_coef": "0.001", "model.capacity_factor": "1.25",
    "model.moe_impl": "xla", "model.lora.rank": "8", "model.lora.alpha": "16.0",
    "model.lora.target_modules": "q_proj,v_proj", "model.lora.use_rslora": "True",
    "model.lora.quantize": "nf4", "model.lora.quant_block": "32", "model.lora.dropout": "0.05",
    "model.lora.init_from": "/nowhere/adapter", "model.lora.modules_to_save": "embed_tokens",
    "mesh.replica": "2", "mesh.fsdp": "2", "mesh.expert": "2", "mesh.context": "2",
    "mesh.tensor": "2", "mesh.stage": "2", "mesh.virtual_stages": "2",
    "mesh.pipeline_schedule": "1f1b",
    "mesh.auto": "True",
    "runtime.cpu_devices": "4", "runtime.coordinator": "localhost:1234",
    "runtime.num_processes": "2", "runtime.process_id": "1",
    "runtime.local_device_ids": "0,1", "runtime.init_timeout": "60",
    "runtime.heartbeat_timeout": "30", "runtime.compilation_cache": "off",
    "train.steps": "7", "train.batch_size": "16", "train.seq_len": "128", "train.seed": "3",
    "train.lr": "1e-4", "train.schedule": "constant", "train.warmup_steps": "0",
    "train.min_lr_ratio": "0.5", "train.weight_decay": "0.0", "train.b1": "0.8",
    "train.b2": "0.999", "train.eps": "1e-6", "train.clip_norm": "0.5",
    "train.opt_state_dtype": "bfloat16", "train.on_nan": "skip", "train.grad_accum": "2",
    "train.microbatches": "4",
    "train.loss_chunk": "64", "train.eval_every": "10", "train.eval_steps": "2",
    "train.epochs": "1.5", "train.warmup_ratio": "0.05", "train.evals_per_epoch": "2",
    "train.objective": "dpo", "preference.beta": "0.5", "preference.label_smoothing": "0.1",
    "preference.simpo_gamma": "1.0", "preference.cpo_alpha": "0.0",
    "preference.desirable_weight": "1.33", "preference.undesirable_weight": "0.75",
    "data.label_field": "good",
    "grpo.num_generations": "4", "grpo.max_completion_length": "64", "grpo.temperature": "0.7",
    "grpo.top_p": "0.9", "grpo.top_k": "50", "grpo.reward_funcs": "my.rewards.fn",
    "grpo.reward_weights": "(1.0, 0.5)", "grpo.loss_type": "grpo", "grpo.epsilon": "0.1",
    "grpo.epsilon_high": "0.28", "grpo.beta": "0.04", "grpo.scale_rewards": "none",
    "grpo.mask_truncated_completions": "True", "grpo.num_iterations": "2",
    "preference.reference": "frozen_copy", "preference.ref_model": "/nowhere/ref",
    "data.chosen_field": "good",
    "data.rejected_field": "bad",
    "checkpoint.saves_per_epoch": "4",
    "data.source": "jsonl", "data.files": "a.jsonl", "data.eval_files": "b.jsonl",
    "data.text_field": "body", "data.messages_field": "conv", "data.prompt_field": "q",
    "data.completion_field": "a", "data.chat_template": "t.jinja", "data.overlong": "truncate",
    "data.role_field": "from", "data.content_field": "value", "data.format": "alpaca",
    "data.eval_fraction": "0.05", "data.roles_to_train": "user,assistant",
    "data.train_on_eos": "all",
    "data.tokenizer": "tok/tokenizer.json", "data.eos_token": "</s>",
    "data.bos_token": "<s>", "data.pad_token": "<pad>", "data.added_tokens": "('<a>', '<b>')",
    "data.added_special_tokens": "('<c>',)",
    "data.token_dtype": "uint16", "data.packing": "False", "data.prefetch": "0",
    "checkpoint.every": "5", "checkpoint.keep": "0", "checkpoint.async_save": "False",
    "checkpoint.resume": "never", "checkpoint.on_unreadable": "stop",
    "log.every": "10", "log.tensorboard": "False", "log.peak_tflops": "989.0",
    "log.profile_steps": "(5, 7)", "log.sample_every": "50", "log.sample_prompt": "def ",
    "log.sample_tokens": "16",
    "log.wandb_project": "sft", "log.wandb_entity": "team", "log.wandb_name": "llama-sft",
    "log.wandb_mode": "offline", "log.wandb_run_id": "sft-1",
    "log.mlflow_tracking_uri": "http://localhost:5000", "log.mlflow_experiment": "sft",
    "log.mlflow_run_name": "llama-sft",
    "debug.nan_at_step": "3",
    "export.hf_dir": "out/hf", "export.dtype": "float32", "export.max_shard_size": "2GB",
    "export.adapter_dir": "out/adapter",
    "rules": "megatron_sp",
}

# A bad value for every field (what a config file could hold), and what the error says
# after "<field>=<value>".
BAD = {
    "model.preset": ("llama9", r": choose one of"),
    **{f"model.{f}": (0, r" must be an int >= 1") for f in
       ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim")},
    "model.rope_theta": (-1.0, r" must be a number > 0"),
    "model.rope_scaling": ({"factr": 2.0}, r": unknown keys \['factr'\]"),
    "model.rms_norm_eps": (0.0, r" must be a number > 0"),
    "model.tie_embeddings": ("yes", r" must be True or False"),
    "model.dtype": ("fp8", r": choose one of"),
    "model.param_dtype": ("float16", r": choose one of"),
    "model.scan_layers": (1, r" must be True or False"),
    "model.remat": ("some", r": choose one of"),
    "model.pipeline_gather_once": ("yes", r" must be True or False"),
    "model.attn_impl": ("flash", r": choose one of"),
    "model.moe_impl": ("fast", r": choose one of"),
    "model.cp_layout": ("striped", r": choose one of"),
    "model.cp_impl": ("ulysses", r": choose one of"),
    "model.attn_kv_tile": (0, r" must be an int >= 1"),
    "model.attn_max_docs": (1, r" must be an int >= 2"),
    "model.init_from": (3, r" must be a string"),
    "model.family": ("gpt2", r": choose one of"),
    "model.qkv_bias": ("yes", r" must be True or False"),
    "model.qk_norm": (1, r" must be True or False"),
    "model.sliding_window": (-1, r" must be an int >= 0"),
    "model.sliding_window_pattern": (0, r" must be an int >= 1"),
    "model.query_pre_attn_scalar": (0.0, r" must be a number > 0"),
    "model.local_rope_theta": (-1.0, r" must be a number > 0"),
    "model.n_experts": (-1, r" must be an int >= 0"),
    "model.experts_per_token": (0, r" must be an int >= 1"),
    "model.moe_ffn_dim": (0, r" must be an int >= 1"),
    "model.shared_expert_dim": (0, r" must be an int >= 1"),
    "model.swiglu_limit": (0.0, r" must be a number > 0"),
    "model.swiglu_alpha": (-1.0, r" must be a number > 0"),
    "model.q_lora_rank": (-1, r" must be an int >= 0"),
    "model.rope_head_dim": (1, r" must be an int >= 2"),
    "model.v_head_dim": (0, r" must be an int >= 1"),
    "model.rope_interleave": ("yes", r" must be True or False"),
    "model.n_group": (0, r" must be an int >= 1"),
    "model.topk_group": (0, r" must be an int >= 1"),
    "model.routed_scaling_factor": (0.0, r" must be a number > 0"),
    "model.kv_lora_rank": (0, r" must be an int >= 1"),
    "model.first_k_dense": (-1, r" must be an int >= 0"),
    "model.score_bias_rate": (-0.1, r" must be a number >= 0"),
    "model.norm_topk_prob": ("yes", r" must be True or False"),
    "model.router_aux_loss_coef": (-0.1, r" must be a number >= 0"),
    "model.router_z_loss_coef": (-0.1, r" must be a number >= 0"),
    "model.capacity_factor": (0.0, r" must be a number > 0"),
    "model.lora.rank": (0, r" must be an int >= 1 \(the adapters' rank"),
    "model.lora.alpha": (0.0, r" must be a number > 0"),
    "model.lora.target_modules": ("q_proj,attn", r": 'attn' is no module LoRA can target; "
                                                 r"use 'all-linear' or names among q_proj"),
    "model.lora.use_rslora": ("yes", r" must be True or False"),
    "model.lora.quantize": ("int4", r": choose one of"),
    "model.lora.quant_block": (1, r" must be an int >= 2 \(values per scale"),
    "model.lora.dropout": (1.0, r" must be a number >= 0 and < 1 \(PEFT's lora_dropout"),
    "model.lora.init_from": (3, r" must be a string"),
    "model.lora.modules_to_save": ("embed_tokens,norm", r": 'norm' cannot be trained beside "
                                                        r"the adapters; name embed_tokens "
                                                        r"and/or lm_head"),
    **{f"mesh.{a}": (2.5, r" must be an int")
       for a in ("replica", "fsdp", "expert", "context", "tensor", "stage")},
    "mesh.virtual_stages": (0, r" must be an int >= 1"),
    "mesh.pipeline_schedule": ("zb", r": choose one of \('gpipe', '1f1b'\)"),
    "mesh.auto": ("yes", r" must be True or False"),
    "runtime.cpu_devices": (0, r" must be an int >= 1"),
    "runtime.coordinator": (1234, r" must be a string"),
    "runtime.num_processes": (0, r" must be an int >= 1"),
    "runtime.process_id": (-1, r" must be an int >= 0"),
    "runtime.local_device_ids": (0, r" must be a string"),
    "runtime.init_timeout": (0, r" must be an int >= 1"),
    "runtime.compilation_cache": ("", r" names no directory"),
    "runtime.heartbeat_timeout": (-5, r" must be an int >= 1"),
    "train.steps": (-1, r" must be an int >= 0"),
    "train.batch_size": (0, r" must be an int >= 1"),
    "train.seq_len": (0, r" must be an int >= 1"),
    "train.seed": (-1, r" must be an int >= 0 and < 4294967296"),
    "train.lr": (-3e-4, r" must be a number >= 0"),
    "train.schedule": ("cosine_with_restarts", r": choose one of"),
    "train.warmup_steps": (-1, r" must be an int >= 0"),
    "train.min_lr_ratio": (1.5, r" must be a number >= 0 and <= 1"),
    "train.weight_decay": (-0.1, r" must be a number >= 0"),
    "train.b1": (1.0, r" must be a number >= 0 and < 1"),
    "train.b2": (1.2, r" must be a number >= 0 and < 1"),
    "train.eps": (0.0, r" must be a number > 0"),
    "train.clip_norm": (-1.0, r" must be a number >= 0"),
    "train.opt_state_dtype": ("fp8", r": choose one of"),
    "train.on_nan": ("ignore", r": choose one of"),
    "train.grad_accum": (0, r" must be an int >= 1"),
    "train.microbatches": (-1, r" must be an int >= 0 \(pipeline micro-batches"),
    "train.loss_chunk": (0, r" must be an int >= 1"),
    "train.eval_every": (-1, r" must be an int >= 0"),
    "train.eval_steps": (0, r" must be an int >= 1"),
    "train.epochs": (-1.0, r" must be a number >= 0"),
    "train.warmup_ratio": (1.5, r" must be a number >= 0 and <= 1"),
    "train.evals_per_epoch": (-1, r" must be an int >= 0"),
    "train.objective": ("ppo", r": choose one of"),
    "preference.beta": (0.0, r" must be a number > 0"),
    "preference.label_smoothing": (0.5, r" must be a number >= 0 and < 0.5"),
    "preference.simpo_gamma": (-1.0, r" must be a number >= 0"),
    "preference.cpo_alpha": (-1.0, r" must be a number >= 0"),
    "preference.desirable_weight": (0.0, r" must be a number > 0"),
    "grpo.num_generations": (1, r" must be an int >= 2"),
    "grpo.max_completion_length": (0, r" must be an int >= 1"),
    "grpo.temperature": (0.0, r" must be a number > 0"),
    "grpo.top_p": (0.0, r" must be a number > 0 and <= 1"),
    "grpo.top_k": (-1, r" must be an int >= 0"),
    "grpo.reward_funcs": (1, r" must be a string"),
    "grpo.reward_weights": (1, r" must be a tuple"),
    "grpo.loss_type": ("ppo", r": choose one of"),
    "grpo.epsilon": (1.0, r" must be a number > 0 and < 1"),
    "grpo.epsilon_high": (-0.1, r" must be a number >= 0"),
    "grpo.beta": (-0.1, r" must be a number >= 0"),
    "grpo.scale_rewards": ("yes", r": choose one of"),
    "grpo.mask_truncated_completions": ("maybe", r" must be True or False"),
    "grpo.num_iterations": (0, r" must be an int >= 1"),
    "preference.undesirable_weight": (0.0, r" must be a number > 0"),
    "preference.reference": ("ref", r": choose one of"),
    "preference.ref_model": (3, r" must be a string"),
    "checkpoint.saves_per_epoch": (-1, r" must be an int >= 0"),
    "data.source": ("webdataset", r": choose one of"),
    **{f"data.{f}": (1, r" must be a string") for f in
       ("files", "eval_files", "text_field", "messages_field", "prompt_field",
        "completion_field", "role_field", "content_field", "chat_template", "tokenizer",
        "chosen_field", "rejected_field", "label_field",
        "eos_token", "bos_token", "pad_token")},
    **{f"data.{f}": (5, r" must be a tuple") for f in ("added_tokens", "added_special_tokens")},
    "data.overlong": ("wrap", r": choose one of"),
    "data.format": ("sharegpt", r": choose one of"),
    "data.roles_to_train": ("human", r": 'human' is not a role; list one or more of"),
    "data.train_on_eos": ("first", r": choose one of \('turn', 'all', 'last', 'none'\)"),
    "data.eval_fraction": (1.0, r" must be a number >= 0 and < 1"),
    "data.token_dtype": ("int8", r": choose one of"),
    "data.packing": ("no", r" must be True or False"),
    "data.prefetch": (-1, r" must be an int >= 0"),
    "checkpoint.every": (-1, r" must be an int >= 0"),
    "checkpoint.keep": (-1, r" must be an int >= 0"),
    "checkpoint.async_save": ("no", r" must be True or False"),
    "checkpoint.resume": ("latest", r": use 'auto', 'never' or a step number"),
    "checkpoint.on_unreadable": ("maybe", r": choose one of \('fallback', 'stop'\)"),
    "log.every": (0, r" must be an int >= 1"),
    "log.tensorboard": (1, r" must be True or False"),
    "log.peak_tflops": (0.0, r" must be a number > 0"),
    "log.profile_steps": ((7, 5), r" must be empty or \(first, last\)"),
    "log.sample_every": (-1, r" must be an int >= 0"),
    "log.sample_prompt": (7, r" must be a string"),
    "log.sample_tokens": (0, r" must be an int >= 1"),
    "log.wandb_project": (1, r" must be a string"),
    "log.wandb_entity": (1, r" must be a string"),
    "log.wandb_name": (1, r" must be a string"),
    "log.wandb_mode": ("dryrun", r": choose one of \('', 'online', 'offline', 'disabled'\)"),
    "log.wandb_run_id": ("team/run", r": a W&B run id has no spaces at either end and none of"),
    "log.mlflow_tracking_uri": (1, r" must be a string"),
    "log.mlflow_experiment": (1, r" must be a string"),
    "log.mlflow_run_name": (1, r" must be a string"),
    "debug.nan_at_step": (1.5, r" must be an int"),
    "export.hf_dir": (1, r" must be a string"),
    "export.adapter_dir": (1, r" must be a string"),
    "export.dtype": ("int8", r": choose one of"),
    "export.max_shard_size": ("5XB", r": write a positive number of bytes"),
}


def test_the_tables_cover_every_field():
    assert set(GOOD) == set(field_paths())
    assert set(BAD) == set(field_paths()) - {"rules"}  # rules: checked against the mesh


def _parse_flags(argv):
    # config_flags applies the overrides it finds in sys_argv when the flag is defined.
    holder = flags.FlagValues()
    flag = config_flags.DEFINE_config_dict("config", default_config(), flag_values=holder,
                                           sys_argv=["prog", *argv])
    holder(["prog", *argv])
    return flag.value


def test_every_field_can_be_set_from_the_command_line():
    config = _parse_flags([f"--config.{k}={v}" for k, v in GOOD.items()])
    settings = Settings.parse(config)
    defaults = Settings.parse(default_config())
    def get(settings, path):
        value = settings
        for name in path.split("."):
            value = getattr(value, name)
        return value

    for path in field_paths():
        assert get(settings, path) != get(defaults, path), path
    assert settings.checkpoint.async_save is False
    assert settings.model.rope_scaling == {"factor": 4.0}
    assert settings.log.profile_steps == (5, 7)


@pytest.mark.parametrize("path", sorted(BAD))
def test_every_field_rejects_a_bad_value(path):
    value, says = BAD[path]
    *groups, name = path.split(".")
    config = default_config().to_dict()
    group = config
    for g in groups:
        group = group[g]
    if path.startswith("model.lora.") and name != "rank":
        group["rank"] = 8  # the group's other fields are read under LoRA
    group[name] = value
    with pytest.raises(ConfigError) as e:
        Settings.parse(config)
    message = str(e.value)
    assert re.match(re.escape(f"{path}={value!r}") + says, message), message
    assert "\n" not in message


def test_unknown_keys_suggest_the_nearest():
    config = default_config().to_dict()
    config["train"]["stpes"] = 3
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'. Did you mean "
                                          r"train.steps\?"):
        Settings.parse(config)


def test_the_keyword_field_is_renamed_and_old_saves_still_read():
    # checkpoint.async could not be set from the command line: 'async' is a keyword.
    assert RENAMED[("checkpoint", "async")] == "async_save"
    assert over_defaults({"checkpoint": {"async": False}}).checkpoint.async_save is False
    config = default_config().to_dict()
    config["checkpoint"] = {"async": False}
    assert Settings.parse(config).checkpoint.async_save is False


@pytest.mark.parametrize("flag, says", [
    ("--config.train.b2=1.5", "train.b2=1.5 must be a number >= 0 and < 1"),
    ("--config.checkpoint.keep=-1", "checkpoint.keep=-1 must be an int >= 0"),
    ("--config.train.clip_norm=-1.0", "train.clip_norm=-1.0 must be a number >= 0"),
    ("--config.model.lora.rank=8 --config.model.lora.target_modules=q_proj,attn",
     "model.lora.target_modules='q_proj,attn': 'attn' is no module LoRA can target"),
])
def test_train_py_reports_a_bad_field_in_one_line(tmp_path, flag, says):
    result = subprocess.run([sys.executable, "train.py", "--config=configs/llama_fsdp_tp.py",
                             *flag.split(), f"--workdir={tmp_path / 'run'}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: {says}"), result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "run").exists()
