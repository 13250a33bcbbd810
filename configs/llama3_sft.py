"""Supervised fine-tuning of Llama 3.2 1B Instruct on chat data: FSDP x TP, 4 x 2 GPUs.

The paths are placeholders to replace (docs/fine-tuning.md):
``CHECKPOINT`` (or --config.model.init_from and --config.data.tokenizer) is a
local Hugging Face Llama directory with its tokenizer.json and chat template,
e.g. from ``hf download meta-llama/Llama-3.2-1B-Instruct --local-dir
checkpoints/Llama-3.2-1B-Instruct``; data.files / data.eval_files are JSON Lines
(or Parquet) rows of ``messages`` or ``prompt`` / ``completion``. Only the
assistant's tokens are learned. The tuned model is written to export.hf_dir.
"""

from ndjax.config import default_config

CHECKPOINT = "checkpoints/Llama-3.2-1B-Instruct"


def get_config():
    c = default_config()
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"

    c.model.init_from = CHECKPOINT      # dims and weights from its config.json + safetensors
    c.model.remat = "full"              # 2048-token rows of a 128k vocabulary: save memory

    c.data.source = "chat"
    c.data.files = "data/chat/train*.jsonl"
    c.data.eval_files = "data/chat/eval*.jsonl"
    c.data.tokenizer = f"{CHECKPOINT}/tokenizer.json"  # its chat template is beside it
    c.data.overlong = "drop"            # a conversation longer than a row is left out, counted

    c.train.seq_len = 2048
    c.train.batch_size = 32             # rows of whole conversations, padded
    c.train.steps = 1000
    # A fine-tuning learning rate: ~100x below pre-training's, short warmup, cosine to 10%.
    c.train.lr = 2e-5
    c.train.schedule = "cosine"
    c.train.warmup_steps = 30
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.0
    c.train.eval_every = 100
    c.train.eval_steps = 8

    c.checkpoint.every = 200
    c.export.hf_dir = f"{CHECKPOINT}-sft"
    c.export.dtype = "bfloat16"
    return c
