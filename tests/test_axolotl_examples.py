"""Axolotl's own example configs (tests/axolotl_examples/, one per example family, each
transcribed from axolotl-ai-cloud/axolotl's examples/ with every field and value as
there) convert without edits once base_model and datasets[].path name local tiny assets,
pass ndjax's checks, and train (issue 48).

Each example is converted with ``--devices`` = the world size it implies, and what it
converts to (mesh, batch, length, data format) and the fields it lists as not mapped are
checked. Training then changes only what a CPU test needs: the workdir and export
folders go under tmp_path, ``train.seq_len`` is capped at ``TRAIN_SEQ`` (the examples'
2048 to 500_000 tokens take minutes a step on 2 CPU cores; the conversion keeps theirs),
and a run whose length is ``max_steps`` trains 3 steps. A length in epochs (num_epochs)
is kept: the tiny data files are sized so that it comes to 3 or 4 steps, counted by
ndjax from the rows an epoch packs into, as Axolotl does."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from data_files import (
    WORDS,
    conversations,
    texts,
    write_chat_jsonl,
    write_chat_tokenizer,
    write_jsonl,
)
from test_families import make_family_hf

from ndjax.config import default_config
from ndjax.data.loader import make_loader
from ndjax.training import loop
from ndjax.verbs import from_axolotl

EXAMPLES = Path(__file__).parent / "axolotl_examples"
AXOLOTL_COMMIT = "067b021c8b87a9e5e380b9173c704cf7340e30f5"
TRAIN_SEQ = 256  # the longest rows the tests train (CPU time); see the module's docstring
VOCAB = 384      # the chat tokenizer's 360 ids fit
# Tiny models of each family the examples name, saved by transformers. Llama and Mistral
# get head_dim 64, as Llama 3.2 1B has (8B: 128): ndjax's NF4 and int8 bases quantize
# blocks of 64 along each weight's last dimension, which the examples' QLoRA and
# load_in_8bit LoRA runs need.
WIDE_HEADS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
MODELS = {  # name: (family, config overrides, chat template of its tokenizer)
    "llama": ("llama", WIDE_HEADS, "llama3"),
    "mistral": ("mistral", {**WIDE_HEADS, "sliding_window": 4096}, "llama3"),  # Mistral 7B's
    "qwen3": ("qwen3", {}, "qwen2_5"),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}, "qwen2_5"),  # Qwen3-30B-A3B's
}


@dataclasses.dataclass(frozen=True)
class Example:
    devices: int           # the world size the example implies (--devices)
    models: dict           # placeholder -> MODELS key
    data: dict             # placeholder -> (kind, records)
    mesh: dict             # replica, fsdp, expert, context, tensor
    batch: tuple           # (train.batch_size, train.grad_accum)
    length: tuple          # ("epochs", n) or ("steps", max_steps)
    data_settings: dict    # data.* the datasets convert to
    not_mapped: set        # the fields listed as not mapped
    steps: int             # the steps the test trains
    evals: bool            # whether it evaluates (val_set_size)
    overrides: dict = dataclasses.field(default_factory=dict)  # other settings to check
    # The mesh the test trains on where the example's needs more than its 8 devices.
    train_mesh: dict = dataclasses.field(default_factory=dict)


ONE = dict(replica=1, fsdp=1, expert=1, context=1, tensor=1)
ALPACA = dict(source="chat", format="alpaca", packing=True)
WANDB = {"wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model"}
LLAMA_LORA = {"eval_sample_packing", *WANDB, "optimizer", "tf32", "resume_from_checkpoint",
              "attn_implementation", "loss_watchdog_threshold", "loss_watchdog_patience"}

CASES = {
    # examples/llama-3/lora-1b.yml: alpaca, LoRA, num_epochs with val_set_size.
    "llama3_lora_1b": Example(
        devices=1, models={"hf": "llama"}, data={"alpaca": ("alpaca", 15)}, mesh=ONE,
        batch=(2 * 2, 2), length=("epochs", 1.0), data_settings={**ALPACA, "eval_fraction": 0.1},
        not_mapped=LLAMA_LORA | {"lora_model_dir"}, steps=3, evals=True,
        overrides={"model.lora.rank": 16, "model.lora.alpha": 32.0, "model.lora.target_modules":
                   "gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj",
                   "train.evals_per_epoch": 4, "checkpoint.saves_per_epoch": 1,
                   "train.warmup_ratio": 0.1, "train.schedule": "cosine", "train.lr": 2e-4}),
    # examples/llama-3/qlora-1b.yml: QLoRA (an NF4 base).
    "llama3_qlora_1b": Example(
        devices=1, models={"hf": "llama"}, data={"alpaca": ("alpaca", 31)}, mesh=ONE,
        batch=(2 * 4, 4), length=("epochs", 1.0), data_settings={**ALPACA, "eval_fraction": 0.1},
        not_mapped=LLAMA_LORA | {"dataset_prepared_path", "load_in_8bit", "lora_model_dir"},
        steps=3, evals=True,
        overrides={"model.lora.quantize": "nf4", "model.lora.rank": 32,
                   "model.lora.alpha": 16.0}),
    # examples/llama-3/instruct-lora-8b.yml: chat_template messages, LoRA on an int8 base,
    # 4 epochs, no packing.
    "llama3_instruct_lora_8b": Example(
        devices=1, models={"hf": "llama"}, data={"chats": ("chats", 10)}, mesh=ONE,
        batch=(2 * 4, 4), length=("epochs", 4.0),
        data_settings=dict(source="chat", packing=False, messages_field="messages",
                           chat_template="llama3", eval_fraction=0.05),
        not_mapped={"model_type", "tokenizer_type", "dataset_prepared_path",
                    *WANDB, "optimizer", "tf32", "resume_from_checkpoint", "attn_implementation",
                    "load_in_4bit", "lora_model_dir"}, steps=4, evals=True,
        overrides={"model.lora.quantize": "int8", "model.lora.target_modules": "all-linear"}),
    # examples/llama-3/fft-8b.yaml: every weight trained, num_epochs with val_set_size.
    "llama3_fft_8b": Example(
        devices=1, models={"hf": "llama"}, data={"alpaca": ("alpaca", 30)}, mesh=ONE,
        batch=(1 * 8, 8), length=("epochs", 1.0),
        data_settings={**ALPACA, "eval_fraction": 0.05},
        not_mapped={"dataset_prepared_path", *WANDB, "optimizer", "tf32",
                    "gradient_checkpointing_kwargs", "resume_from_checkpoint",
                    "attn_implementation"}, steps=3, evals=True,
        overrides={"train.evals_per_epoch": 2, "train.lr": 2e-5}),
    # examples/mistral/lora.yml: Mistral, alpaca, lora_target_linear beside a list.
    "mistral_lora": Example(
        devices=1, models={"hf": "mistral"}, data={"alpaca": ("alpaca", 31)}, mesh=ONE,
        batch=(2 * 4, 4), length=("epochs", 1.0), data_settings={**ALPACA, "eval_fraction": 0.1},
        not_mapped=(LLAMA_LORA - {"eval_sample_packing"}) | {
            "model_type", "tokenizer_type", "dataset_prepared_path", "load_in_4bit",
            "lora_model_dir", "special_tokens"},  # special_tokens: empty there
        steps=3, evals=True,
        overrides={"model.lora.quantize": "int8", "model.lora.target_modules": "all-linear"}),
    # examples/alst/llama3-8b-fsdp2-alst.yaml: context parallelism over 8 GPUs, two
    # completion datasets (the second, another text field, is listed).
    "alst_llama3_8b_fsdp2": Example(
        devices=8, models={"hf": "llama"},
        data={"long_text": ("text", 26), "chapters": ("chapter", 6)},
        mesh={**ONE, "context": 8}, batch=(1, 1), length=("epochs", 1.0),
        data_settings=dict(source="chat", format="completion", text_field="text", packing=True),
        not_mapped={"datasets[0].data_files", "datasets[1]", "dataset_prepared_path",
                    "min_sample_len", "tiled_mlp", "plugins", "optimizer", "tf32",
                    "activation_offloading", "resume_from_checkpoint", "attn_implementation",
                    "evals_per_epoch", "fsdp_version", "fsdp_config",
                    "val_set_size"},
        steps=3, evals=False,
        overrides={"train.seq_len": 500_000, "train.loss_chunk": 1000,
                   "train.warmup_steps": 100}),
    # examples/distributed-parallel/qwen3-8b-fsdp-tp-cp.yaml: FSDP x TP x CP on 8 GPUs.
    "qwen3_8b_fsdp_tp_cp": Example(
        devices=8, models={"hf": "qwen3"}, data={"alpaca": ("alpaca", 5)},
        mesh={**ONE, "fsdp": 2, "context": 2, "tensor": 2}, batch=(1 * 1 * 2, 1),
        length=("epochs", 2.0), data_settings=ALPACA,
        not_mapped={"plugins", "dataset_prepared_path", "fsdp_version", "fsdp_config",
                    "attn_implementation", "tf32", "special_tokens"}, steps=4, evals=False,
        overrides={"train.schedule": "constant", "train.warmup_ratio": 0.1,
                   "model.dtype": "bfloat16", "train.lr": 2e-6}),
    # examples/distributed-parallel/llama-3_1-8b-hsdp-tp.yaml: HSDP (dp_replicate x
    # dp_shard) x TP on 16 GPUs, trained on 8 with dp_shard 2.
    "llama31_8b_hsdp_tp": Example(
        devices=16, models={"hf": "llama"}, data={"alpaca": ("alpaca", 20)},
        mesh={**ONE, "replica": 2, "fsdp": 4, "tensor": 2}, batch=(1 * 1 * 2 * 4, 1),
        length=("epochs", 2.0), data_settings=ALPACA,
        not_mapped={"plugins", "dataset_prepared_path", "fsdp_version",
                    "fsdp_config", "attn_implementation", "tf32"}, steps=4, evals=False,
        train_mesh={"fsdp": 2},
        overrides={"train.schedule": "constant", "train.warmup_ratio": 0.1,
                   "model.dtype": "bfloat16", "train.lr": 2e-6}),
    # examples/expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml: a mixture of experts split
    # over 4 GPUs, LoRA on attention, max_steps.
    "qwen3_moe_ep_lora_4gpu": Example(
        devices=4, models={"hf_moe": "qwen3_moe"}, data={"alpaca": ("alpaca", 20)},
        mesh={**ONE, "expert": 4}, batch=(1 * 1 * 4, 1), length=("steps", 50),
        data_settings=ALPACA,
        not_mapped={"plugins", "experts_implementation", "dataset_prepared_path",
                    "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "optimizer", "tf32",
                    "flash_attention", "saves_per_epoch", "lora_dropout", "evals_per_epoch"},
        steps=3, evals=False,
        overrides={"model.lora.target_modules": "q_proj,k_proj,v_proj,o_proj",
                   "train.warmup_steps": 5, "train.seed": 42, "model.family": "qwen3_moe"}),
}


# ----- the tiny assets ----------------------------------------------------------

def alpaca_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` alpaca records (instruction, input, output), every other one with an input."""
    rng = np.random.default_rng(seed)
    say = lambda: " ".join(rng.choice(WORDS, rng.integers(2, 7)))  # noqa: E731
    return [{"instruction": f"{say()}?", "input": say() if i % 2 else "", "output": say()}
            for i in range(n)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Paths of the tiny assets, made on first use: a model directory (config.json,
    safetensors, tokenizer.json, tokenizer_config.json with a chat template) of each
    family, and data files of each kind and size."""
    root = tmp_path_factory.mktemp("axolotl_examples")
    made: dict = {}

    def model(name: str) -> str:
        if name not in made:
            family, overrides, template = MODELS[name]
            directory = root / name
            make_family_hf(directory, family, vocab_size=VOCAB, max_position_embeddings=8192,
                           **overrides)
            tokenizer = write_chat_tokenizer(root / f"tokenizer_{name}", template)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tokenizer.parent / file, directory)
            made[name] = str(directory)
        return made[name]

    def data(kind: str, n: int) -> str:
        path = root / f"{kind}_{n}.jsonl"
        if not path.exists():
            if kind == "alpaca":
                path.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(n)))
            elif kind == "chats":
                write_chat_jsonl(path, conversations(n))
            else:  # completion text under this field
                write_jsonl(path, texts(n, seed=len(kind)), field=kind)
        return str(path)

    return model, data


def render_yaml(name: str, example: Example, assets) -> dict:
    """The example's YAML with its placeholders (``{hf}``, ``{alpaca}``) filled in."""
    model, data = assets
    names = {**{k: model(v) for k, v in example.models.items()},
             **{k: data(*v) for k, v in example.data.items()}}
    text = (EXAMPLES / f"{name}.yml").read_text()
    assert set(re.findall(r"\{(\w+)\}", text)) == set(names), name
    return yaml.safe_load(re.sub(r"\{(\w+)\}", lambda m: names[m.group(1)], text))


def unaccounted(raw: dict, conv: from_axolotl.Conversion) -> set[str]:
    """The keys (top level, and each dataset's) neither listed as not mapped nor named in
    a mapped setting's note (tests/test_from_axolotl.py's assert_every_field_accounted_for,
    as a set)."""
    unmapped = {u.field for u in conv.unmapped}
    notes = " ".join(conv.notes.values())
    out = {key for key in raw if key not in unmapped and not re.search(rf"\b{key}\b", notes)
           and not any(u.startswith((f"{key}[", f"{key}.")) for u in unmapped)}
    for i, entry in enumerate(raw.get("datasets") or []):
        where = f"datasets[{i}]"
        out |= {f"{where}.{key}" for key in entry if where not in unmapped
                and f"{where}.{key}" not in unmapped and key not in ("path", "type", "field")}
    return out


def test_every_example_file_has_a_case():
    assert sorted(p.stem for p in EXAMPLES.glob("*.yml")) == sorted(CASES)
    for path in EXAMPLES.glob("*.yml"):
        assert f"(axolotl-ai-cloud/axolotl@{AXOLOTL_COMMIT[:12]})" in path.read_text(), path


@pytest.mark.parametrize("name", sorted(CASES))
def test_axolotl_example_converts_unchanged_and_trains(name, assets, tmp_path):
    example = CASES[name]
    raw = render_yaml(name, example, assets)
    conv = from_axolotl.convert(raw, devices=example.devices)
    assert conv.problems == []
    o = conv.overrides
    assert {a: o[f"mesh.{a}"] for a in ONE} == example.mesh
    assert o["runtime.cpu_devices"] == example.devices
    assert (o["train.batch_size"], o["train.grad_accum"]) == example.batch
    kind, length = example.length
    assert o[f"train.{kind}"] == length
    assert ("train.steps" in o) == (kind == "steps")
    for key, value in example.data_settings.items():
        assert o[f"data.{key}"] == value, key
    assert ("data.eval_fraction" in o) == example.evals
    assert o["train.seq_len"] == raw["sequence_len"]
    for key, value in example.overrides.items():
        assert o[key] == value, key
    assert o["model.init_from"] == raw.get("base_model")
    assert {u.field for u in conv.unmapped} == example.not_mapped, [
        u.line() for u in conv.unmapped]
    assert not unaccounted(raw, conv)  # every field mapped or listed

    # The file the CLI would write, with ndjax's checks of it.
    text = from_axolotl.render(conv, f"{name}.yml")
    from_axolotl.check(text, conv)
    config = from_axolotl.load(text)

    # What a CPU test changes: the folders, the row length, a max_steps length.
    for key in ("hf_dir", "adapter_dir"):
        if config.export[key]:
            config.export[key] = str(tmp_path / key)
    if config.train.seq_len > TRAIN_SEQ:
        config.train.seq_len = TRAIN_SEQ
        config.train.loss_chunk = default_config().train.loss_chunk
    for axis, size in example.train_mesh.items():
        config.mesh[axis] = size
    devices = math.prod(config.mesh[axis] for axis in ONE)
    config.runtime.cpu_devices = devices
    if kind == "steps":
        config.train.steps = 3
    else:  # the epochs as given: the data makes them short
        with make_loader(config, VOCAB, prefetch=0) as loader:
            rows = loader.rows_per_epoch()
        batch = config.train.batch_size
        assert math.ceil(length * max(rows // batch, 1)) == example.steps, (rows, batch)
    records = loop.train(config, str(tmp_path / "run"), devices=jax.devices()[:devices],
                         verbose=False)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == example.steps and all(math.isfinite(x) for x in losses), records
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert bool(evals) == example.evals and all(math.isfinite(x) for x in evals), records
    exported = Path(config.export.adapter_dir or config.export.hf_dir)
    assert (exported / ("adapter_config.json" if config.export.adapter_dir
                        else "config.json")).exists()
