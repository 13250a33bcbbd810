"""Train a Llama model on a 4-axis mesh.

    python train.py --config=configs/llama_fsdp_tp.py [--config.train.steps=50] \
        [--workdir=runs/fsdp_tp] [--print_sharding]

Bad input (a mesh that does not fit the devices, a model the mesh cannot split,
an unknown config key, ...) is reported as one line on stderr with exit code 2;
a checkpoint that could not be saved (disk full, ...) as one line, exit code 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import app, flags
from ml_collections import config_flags

from ndjax.runtime.cli import BAD_OVERRIDE, config_flags_parser, fail, innermost
from ndjax.runtime.console import start_jax_quietly

# Before the config file (which imports jax) loads: without a GPU, the gpu-compile
# extra's CUDA plugin would print its tracebacks ahead of train.py's first line.
start_jax_quietly()


def _fail(message: object, exit: Callable[[int], object] = sys.exit) -> None:
    fail("train.py", message, exit)


try:
    # config_flags applies the --config.* overrides to the default file as soon
    # as the flag is defined, so a bad override is reported from here.
    _CONFIG = config_flags.DEFINE_config_file(
        "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                               "llama_fsdp_tp.py"),
        "Experiment config file (configs/*.py).")
except BAD_OVERRIDE as e:
    _fail(f"bad --config override: {innermost(e)}")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics (and later checkpoints) go; default runs/<config name>.")
_PRINT_SHARDING = flags.DEFINE_bool(
    "print_sharding", False, "Print where every parameter lives, then exit.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from ndjax.runtime.console import quiet_libraries
    quiet_libraries("train.py")
    try:
        config = _CONFIG.value  # loads the file and applies --config.* overrides
        config.runtime  # noqa: B018 -- a config file that failed to load raises on access
    except OSError as e:
        _fail(f"cannot load --config: {innermost(e)}")
    except BAD_OVERRIDE as e:
        _fail(f"bad --config override: {innermost(e)}")

    from ndjax.parallel import distributed
    from ndjax.runtime import xla_cache
    from ndjax.runtime.errors import ConfigError
    try:
        # Before anything compiles: a second run of the same step loads it.
        # (distributed.initialize may turn it off again: multi-process CPU runs.)
        xla_cache.configure(config.runtime.get("compilation_cache", xla_cache.AUTO))
        # Before anything creates a JAX backend: the CPU device count, and the
        # other processes of a multi-process run.
        distributed.initialize(config.runtime, on_timeout=lambda m: _fail(m, exit=os._exit))
    except ConfigError as e:
        _fail(e)

    from ndjax.experiment import Experiment
    from ndjax.runs.checkpoint_faults import SaveError
    from ndjax.training.loop import NonFiniteError, train
    from ndjax.training.report import sharding_table
    from ndjax.training.stop_signals import Interrupted

    config_name = os.path.splitext(os.path.basename(
        config_flags.get_config_filename(flags.FLAGS["config"])))[0]
    workdir = _WORKDIR.value or os.path.join("runs", config_name)
    label = distributed.label()  # "process 1 of 2: " in a multi-process run

    def lost_peer(message: str) -> None:
        # Called from the watch thread while the main thread may be stuck in a
        # collective: say who was lost, then leave without waiting for anyone.
        print(f"train.py: error: {label}{message} Checkpoints in "
              f"{os.path.join(workdir, 'checkpoints')} are intact up to the last complete "
              "one; start every process again to resume from it.", file=sys.stderr, flush=True)
        os._exit(4)

    watch = None

    def stop_with_the_others() -> None:
        # Every process stops for the same reason here, so none of them is lost.
        if watch is not None:
            watch.stop()
        distributed.leave()

    try:
        distributed.handshake(config)
        watch = distributed.PeerWatch(lost_peer, config.runtime.heartbeat_timeout)
        if _PRINT_SHARDING.value:
            print(sharding_table(Experiment.from_config(config)))
        else:
            train(config, workdir)
        distributed.finish(watch)
    except ConfigError as e:
        stop_with_the_others()
        _fail(f"{label}{e}")
    except Interrupted:  # saved: the loop said so
        stop_with_the_others()
        sys.exit(130)
    except KeyboardInterrupt:  # before the loop listened for it: nothing to save yet
        print(f"train.py: {label}Ctrl-C before the first step; nothing was saved.",
              file=sys.stderr, flush=True)
        stop_with_the_others()
        sys.exit(130)
    except NonFiniteError as e:
        print(f"train.py: stopped: {label}{e}", file=sys.stderr, flush=True)
        stop_with_the_others()
        sys.exit(3)
    except SaveError as e:
        # Exit 1, not ConfigError's 2: the config is fine and the same command is the
        # right one to run again, once the disk has room (2 is for usage errors, as
        # absl and argparse use it). One line, as for every failure train.py explains.
        print(f"train.py: error: {label}{e}", file=sys.stderr, flush=True)
        stop_with_the_others()
        # Without the interpreter's shutdown: it would collect the failed save's
        # unfinished write futures and print each one's error. Everything the run
        # opened was closed on the way here (ndjax.training.loop.train's ExitStack).
        sys.stdout.flush()
        os._exit(1)
    except Exception as e:
        if watch is not None and label:
            # A failed collective usually means a peer died: let the watch name it.
            first_line = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"train.py: {label}{type(e).__name__}: {first_line}; checking whether "
                  "another process was lost", file=sys.stderr, flush=True)
            watch.wait_for_verdict()
        # Anything else keeps its traceback; in a multi-process run, say whose it is.
        if label:
            print(f"train.py: {label}failed:", file=sys.stderr)
        raise


if __name__ == "__main__":
    app.run(main, flags_parser=config_flags_parser("train.py"))
