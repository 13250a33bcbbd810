"""Shared test helpers: run a few train steps of an Experiment."""

from __future__ import annotations

import jax
import numpy as np

from ndjax.data.synthetic import SyntheticSource
from ndjax.experiment import Experiment


def host_batches(config, steps):
    t = config.train
    source = SyntheticSource(config.model.vocab_size, t.seq_len, t.seed)
    return [source.rows(i, 0, t.batch_size) for i in range(steps)]


def run_steps(exp: Experiment, initial_state=None, steps: int | None = None):
    """Runs the compiled step; returns (losses, final params on the host).

    ``initial_state`` (host arrays) is placed in this layout's shardings, so
    every layout starts from bit-identical parameters.
    """
    steps = exp.config.train.steps if steps is None else steps
    if initial_state is None:
        state = exp.init_state()
    else:
        state = jax.device_put(initial_state, exp.state_sharding)
    losses = []
    for batch in host_batches(exp.config, steps):
        state, metrics = exp.compiled_step(state, exp.device_batch(batch))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)
