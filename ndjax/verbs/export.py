r"""Export a training checkpoint as a Hugging Face Llama directory.

    ndjax export --workdir=runs/llama_fsdp_tp --out=hf/llama [--step=N] \
        [--dtype=bfloat16] [--adapters]

The run's experiment is rebuilt from ``<workdir>/config.json`` (written by
train.py): the same model, mesh and rules, so run this where the run's devices
are (on a CPU host, ``runtime.cpu_devices`` of that config simulates them).
Step N (default: the newest complete checkpoint) is restored and written as
``export.hf_dir`` would have been, with the token ids and tokenizer files of the
run's ``data.tokenizer``. Under ``model.lora`` the adapters are merged into the base;
``--adapters`` writes them alone in PEFT's format instead (``export.adapter_dir``'s).
Bad input is one line on stderr, exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import app, flags

from ndjax.runtime.cli import show_in_help
from ndjax.runtime.console import quiet_libraries, start_jax_quietly

start_jax_quietly()  # before jax: the CUDA plugin's lines on a machine without a GPU
import jax  # noqa: E402

from ndjax.experiment import Experiment  # noqa: E402
from ndjax.runs import hf  # noqa: E402
from ndjax.runs import workdir as workdir_lib  # noqa: E402
from ndjax.runs.checkpoint import saved_step  # noqa: E402
from ndjax.runtime.errors import ConfigError  # noqa: E402


def export_checkpoint(workdir: str, out: str, step: int | None = None,
                      dtype: str | None = None,
                      devices: Sequence[jax.Device] | None = None,
                      adapters: bool = False) -> int:
    """Writes checkpoint ``step`` (None: the newest) of the run in ``workdir`` to ``out``
    as a Hugging Face directory (``adapters``: a LoRA's adapters in PEFT's format);
    returns the step."""
    config = workdir_lib.run_config(workdir)  # the copies the run keeps, not its sources
    config.export.hf_dir, config.export.adapter_dir = (None, out) if adapters else (out, None)
    if dtype is not None:
        config.export.dtype = dtype
    exp = Experiment.from_config(config, devices)  # checks out and dtype too
    with saved_step(workdir, exp.settings.checkpoint, step) as (checkpointer, step):
        state, _ = checkpointer.restore(step, exp.abstract_saved_state)
    if adapters:  # the adapters alone: the frozen base is not read
        hf.export_adapter(state.params, exp.model_cfg, out, config.model.init_from)
        return step
    # The run's tokenizer: its ids and files describe what the weights were trained on.
    hf.export(exp.with_base(state.params), exp.model_cfg, out, config.export.dtype,
              source=workdir_lib.source(workdir),
              shard_bytes=hf.shard_size(config.export.max_shard_size),
              tokenizer=hf.run_tokenizer(config.data))
    return step


def define_flags() -> list[flags.FlagHolder]:
    """The command line's flags (read as ``flags.FLAGS.name``), defined by ``main``, not
    on import: see ndjax/verbs/__init__.py."""
    f = flags
    return [
        f.DEFINE_string("workdir", None, "The --workdir of a train.py run."),
        f.DEFINE_string("out", None, "The Hugging Face directory to write (must not exist "
                        "or be empty)."),
        f.DEFINE_integer("step", None, "Checkpoint step; default: the newest."),
        f.DEFINE_string("dtype", None, "bfloat16, float16 or float32; default: the run's "
                        "export.dtype."),
        f.DEFINE_boolean("adapters", False, "A LoRA run's adapters alone, in PEFT's format "
                         "(adapter_model.safetensors, adapter_config.json), not merged."),
    ]


def run(argv: list[str]) -> None:
    """The program, on the parsed flags."""
    args = flags.FLAGS  # the parsed command line
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_libraries("ndjax export")
    try:
        if not args.workdir or not args.out:
            raise ConfigError("--workdir and --out are required.")
        config = workdir_lib.run_config(args.workdir)
        # Before JAX creates its backends, as train.py does (CPU hosts only).
        jax.config.update("jax_num_cpu_devices", int(config.runtime.cpu_devices))
        step = export_checkpoint(args.workdir, args.out, args.step, args.dtype,
                                 adapters=args.adapters)
    except ConfigError as e:
        print(f"ndjax export: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    print(f"exported checkpoint step {step} of {args.workdir} to {args.out}")


def main() -> None:
    """``ndjax export``."""
    show_in_help(define_flags())
    app.run(run)


if __name__ == "__main__":
    main()
