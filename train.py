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

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/llama_fsdp_tp.py", "Experiment config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics (and later checkpoints) go; default runs/<config name>.")
_PRINT_SHARDING = flags.DEFINE_bool(
    "print_sharding", False, "Print where every parameter lives, then exit.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value

    # The CPU device count must be set before JAX creates its backends. It only
    # affects the CPU backend, so it is harmless on GPU hosts.
    import jax
    jax.config.update("jax_num_cpu_devices", int(config.runtime.cpu_devices))

    from ndjax.errors import ConfigError
    from ndjax.experiment import Experiment
    from ndjax.loop import train
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
        print(f"train.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
