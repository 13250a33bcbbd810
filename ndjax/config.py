"""Experiment configuration: the defaults every config file starts from.

A config file (``configs/*.py``) calls ``default_config()`` and changes what
its experiment needs; command-line flags (``--config.train.steps=5``) change
the rest. ``check_keys`` rejects keys that the defaults do not know, so a typo
is an error instead of a silently ignored setting.
"""

from __future__ import annotations

import difflib
import json
import os

import ml_collections
from ml_collections import config_dict

from ndjax.errors import ConfigError


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"
    # Dims left at None come from the preset.
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "head_dim"):
        c.model[field] = config_dict.placeholder(int)
    c.model.rope_theta = config_dict.placeholder(float)
    c.model.tie_embeddings = config_dict.placeholder(bool)
    c.model.dtype = "auto"        # compute dtype: auto = bfloat16 on GPU/TPU, float32 on CPU
    c.model.param_dtype = "float32"  # dtype parameters are stored in: float32 | bfloat16
    # The decoder layers: True = one scanned block (compile time flat in depth),
    # False = unrolled; unset = unrolled on CPU up to 8 layers, else scanned
    # (ndjax.models.llama.default_scan_layers says why).
    c.model.scan_layers = config_dict.placeholder(bool)
    c.model.remat = "none"        # none | full | save_proj | save_attn
    # Attention: auto = ring over mesh.context, cuDNN or Pallas on a GPU, else by
    # length: dense, blocked, tiled (ndjax.ops.attention.choose); or
    # a kernel by name. Ring attention's layout (zigzag balances the causal work,
    # contiguous does not) and the tiled and ring key tile (memory O(local_len x tile)).
    c.model.attn_impl = "auto"
    c.model.cp_layout = "zigzag"
    c.model.attn_kv_tile = 512
    # The most documents one row may hold where the kernel needs a bound: cudnn keeps
    # softmax statistics for max_docs x seq_len per head and layer (a row's padding
    # counts as one document). A batch with more stops the run, naming this field.
    c.model.attn_max_docs = 64
    # A local Hugging Face Llama directory (config.json + safetensors): its
    # config.json sets the dims above and its weights the initial parameters.
    c.model.init_from = config_dict.placeholder(str)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.replica = 1
    c.mesh.fsdp = -1              # -1: all remaining devices
    c.mesh.context = 1
    c.mesh.tensor = 1

    # A preset name from ndjax.rules.PRESETS, or a full table of
    # (logical_name, mesh_axes) pairs.
    c.rules = config_dict.FieldReference("default", field_type=object)

    c.runtime = ml_collections.ConfigDict()
    c.runtime.cpu_devices = 8     # simulated devices per process on a CPU-only host; ignored on GPU
    # Several processes (one per host or per GPU) joined by jax.distributed. Left
    # unset, a launcher's environment (srun, mpirun, JAX_COORDINATOR_ADDRESS)
    # decides, and a plain single-process run needs nothing. See the README's
    # "Multiple hosts" section.
    c.runtime.coordinator = config_dict.placeholder(str)  # host:port of process 0
    c.runtime.num_processes = config_dict.placeholder(int)
    c.runtime.process_id = config_dict.placeholder(int)
    # GPUs this process uses, e.g. "0,1,2,3,4,5,6,7"; unset: all (under srun, jax
    # gives each task only the GPU of its SLURM_LOCALID unless this is set).
    c.runtime.local_device_ids = config_dict.placeholder(str)
    c.runtime.init_timeout = 300    # seconds to wait for the coordinator and every process
    # A process silent for this many seconds is declared dead and the others stop.
    c.runtime.heartbeat_timeout = 100

    c.train = ml_collections.ConfigDict()
    # Defaults are the CPU demo (tiny model, builtin corpus): the loss falls from
    # 7.8 to about 2.7 in 100 steps.
    c.train.steps = 100
    c.train.batch_size = 8        # global batch, in rows of seq_len tokens
    c.train.seq_len = 64
    c.train.seed = 0
    c.train.lr = 3e-3
    c.train.schedule = "cosine"   # cosine (warmup + cosine decay) | constant (warmup + flat)
    c.train.warmup_steps = 5
    c.train.min_lr_ratio = 0.1    # cosine decays to lr * min_lr_ratio
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.clip_norm = 1.0       # global-norm clipping; 0 disables
    # dtype AdamW's two moments are stored in: float32 | bfloat16 (computed in float32).
    c.train.opt_state_dtype = "float32"
    # A NaN/Inf loss or gradient norm: "stop" (exit non-zero, save nothing) or
    # "skip" (drop that update, count it in the metrics).
    c.train.on_nan = "stop"
    # Micro-batches per step: the batch runs as grad_accum slices of batch_size /
    # grad_accum rows in one jitted step, gradients summed (activation memory of
    # one slice; the update is the same as one big batch's).
    c.train.grad_accum = 1
    # Sequence positions per chunk of the LM head + cross-entropy: the logits of
    # one chunk exist at a time, never the whole batch's (b x seq x vocab).
    c.train.loss_chunk = 1024
    c.train.eval_every = 0        # loss on the validation split every N steps; 0 = never
    c.train.eval_steps = 4        # batches per evaluation (the same ones every time)

    # Where batches come from (see ndjax/data/ and the README's Data section).
    c.data = ml_collections.ConfigDict()
    # builtin: this Python's standard library source | synthetic: a seeded Markov
    # chain | text | jsonl | parquet: local files | tokens: pre-tokenized files |
    # chat: conversations (JSON Lines or Parquet)
    c.data.source = "builtin"
    c.data.files = ""             # comma-separated paths or globs (the file sources)
    c.data.eval_files = ""        # the validation split of those sources, same format
    c.data.text_field = "text"    # JSON Lines key / Parquet column holding the text
    # chat: JSON Lines / Parquet conversations, rendered with the tokenizer's chat
    # template; only the assistant's tokens are learned (README "Fine-tuning on chat data").
    c.data.messages_field = "messages"      # a list of {role, content}
    c.data.prompt_field = "prompt"          # or a prompt (user) ...
    c.data.completion_field = "completion"  # ... and completion (assistant) pair
    c.data.chat_template = ""     # a Jinja template file; "" = the tokenizer's own
    c.data.overlong = "drop"      # a conversation longer than seq_len + 1 tokens: drop | truncate
    c.data.tokenizer = "byte"     # byte (256 bytes + EOS/BOS/PAD) or a tokenizer.json path
    c.data.eos_token = ""         # a tokenizer.json's end-of-document token; "" = guess
    c.data.token_dtype = "auto"   # raw token files: uint16 | uint32; auto = from the sidecar
    c.data.packing = True         # pack documents into full rows; False: one piece per row
    c.data.prefetch = 2           # batches a loader thread prepares ahead; 0 = no thread

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0        # save every N steps (0: only at the end and on SIGTERM)
    c.checkpoint.keep = 3         # newest checkpoints kept (0: all)
    c.checkpoint["async"] = True  # write files in the background while training goes on
    c.checkpoint.resume = "auto"  # auto (newest complete one) | never | a step number

    c.log = ml_collections.ConfigDict()
    c.log.every = 1
    c.log.tensorboard = True      # event files under <workdir>/tb/
    c.log.peak_tflops = config_dict.placeholder(float)  # per device; default from the device kind
    c.log.profile_steps = ()      # (first, last): jax.profiler trace into <workdir>/profile/

    c.debug = ml_collections.ConfigDict()
    c.debug.nan_at_step = -1      # poison the loss at this step (tests of train.on_nan)

    c.export = ml_collections.ConfigDict()
    # At the end of training, write a directory that transformers loads
    # (AutoModelForCausalLM.from_pretrained); None: no export.
    c.export.hf_dir = config_dict.placeholder(str)
    c.export.dtype = "bfloat16"   # of the exported weights: bfloat16 | float16 | float32
    # Largest weight file, bytes (int) or "5GB" / "500MB" / "2GiB"; bigger models are split
    # into files with an index, as transformers does. The host holds one file while writing.
    c.export.max_shard_size = config_dict.FieldReference("5GB", field_type=object)
    return c


def check_keys(config: ml_collections.ConfigDict,
               defaults: ml_collections.ConfigDict | None = None, prefix: str = "") -> None:
    """Raises ConfigError for any key that the defaults do not have."""
    defaults = default_config() if defaults is None else defaults
    for key in config.keys():
        name = f"{prefix}{key}"
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults.keys()), n=1)
            hint = f" Did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(
                f"unknown config key {name!r}.{hint} Known keys here: "
                f"{', '.join(prefix + k for k in sorted(defaults.keys()))}.")
        value, default = config[key], defaults[key]
        if isinstance(default, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"config key {name!r} must be a group of fields, got {value!r}.")
            check_keys(value, default, prefix=f"{name}.")


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a train.py run saved in its workdir."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--workdir={workdir!r} has no config.json: point it at the --workdir "
                          "of a train.py run.")
    with open(path) as f:
        saved = json.load(f)
    # Over the defaults: a run saved before a field existed (model.param_dtype,
    # train.opt_state_dtype) gets that field's default, which is what it ran with.
    config = default_config()
    config.update(saved)
    return config
