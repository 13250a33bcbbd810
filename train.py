"""Train a Llama model on a 4-axis mesh.

    python train.py --config=configs/llama_fsdp_tp.py [--config.train.steps=50] \
        [--workdir=runs/fsdp_tp] [--print_sharding]

Bad input (a mesh that does not fit the devices, a model the mesh cannot split,
an unknown config key, ...) is reported as one line on stderr with exit code 2.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags


def _innermost(e: BaseException) -> str:
    """config_flags wraps the useful message in layers of exceptions."""
    while isinstance(e, BaseException) and e.args:
        e = e.args[0]
    return str(e)


def _fail(message: object) -> None:
    print(f"train.py: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


_BAD_OVERRIDE = (AttributeError, KeyError, TypeError, ValueError)
try:
    # config_flags applies the --config.* overrides to the default file as soon
    # as the flag is defined, so a bad override is reported from here.
    _CONFIG = config_flags.DEFINE_config_file(
        "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                               "llama_fsdp_tp.py"),
        "Experiment config file (configs/*.py).")
except _BAD_OVERRIDE as e:
    _fail(f"bad --config override: {_innermost(e)}")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics (and later checkpoints) go; default runs/<config name>.")
_PRINT_SHARDING = flags.DEFINE_bool(
    "print_sharding", False, "Print where every parameter lives, then exit.")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with a bad ``--config.x=...`` override as one line, not a traceback."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(e)
    except _BAD_OVERRIDE as e:
        _fail(f"bad --config override: {_innermost(e)}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        config = _CONFIG.value  # loads the file and applies --config.* overrides
        config.runtime  # noqa: B018 -- a config file that failed to load raises on access
    except OSError as e:
        _fail(f"cannot load --config: {_innermost(e)}")
    except _BAD_OVERRIDE as e:
        _fail(f"bad --config override: {_innermost(e)}")

    # The CPU device count must be set before JAX creates its backends. It only
    # affects the CPU backend, so it is harmless on GPU hosts.
    import jax
    jax.config.update("jax_num_cpu_devices", int(config.runtime.cpu_devices))

    from ndjax.errors import ConfigError
    from ndjax.experiment import Experiment
    from ndjax.loop import NonFiniteError, train
    from ndjax.report import sharding_table

    config_name = os.path.splitext(os.path.basename(
        config_flags.get_config_filename(flags.FLAGS["config"])))[0]
    workdir = _WORKDIR.value or os.path.join("runs", config_name)
    try:
        if _PRINT_SHARDING.value:
            print(sharding_table(Experiment.from_config(config)))
            return
        train(config, workdir)
    except ConfigError as e:
        _fail(str(e))
    except NonFiniteError as e:
        print(f"train.py: stopped: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
