"""The train step takes its loss from an objective (ndjax.step.objectives): the
cross-entropy against a plain log-softmax of the model's logits, and a different
objective given to the step is the one it minimises and reports."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from conftest import tiny_config
from helpers import host_batches

from ndjax.experiment import Experiment
from ndjax.parallel import rules as rules_lib
from ndjax.step.objectives import CrossEntropy
from ndjax.step.train_step import eval_step, loss_and_grads


@dataclasses.dataclass(frozen=True)
class PerRow(CrossEntropy):
    """The same sum, averaged over the batch's rows rather than its tokens."""

    def weight(self, batch):
        return jnp.asarray(batch["inputs"].shape[0], jnp.float32)


def test_cross_entropy_is_the_steps_loss_and_another_objective_replaces_it():
    config = tiny_config(mesh=dict(fsdp=4, tensor=2))
    config.train.loss_chunk = 8  # the head in chunks: more than one per row
    exp = Experiment.from_config(config)
    assert isinstance(exp.step_options.objective, CrossEntropy)
    state = exp.init_state()
    batch = exp.device_batch(host_batches(config, 1)[0])

    # The reference: every kept token's -log softmax(logits)[target], in float64.
    logits = np.asarray(exp.apply(state.params, batch["inputs"], batch["positions"],
                                  batch["segment_ids"]), np.float64)
    targets, mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                            keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    total = (nll * mask).sum()

    def losses(options):
        with rules_lib.use(exp.rules):
            loss, tokens, _ = jax.jit(lambda p, b: loss_and_grads(exp.features, options, p, b)
                                      )(state.params, batch)
            ev = jax.jit(lambda p, b: eval_step(exp.features, options.objective,
                                                options.loss_chunk, p, b))(state.params, batch)
        return float(loss), float(tokens), float(ev["loss"])

    loss, tokens, ev = losses(exp.step_options)
    assert tokens == mask.sum() > 0
    np.testing.assert_allclose([loss, ev], total / mask.sum(), rtol=1e-5)  # f32 vs f64

    rows = batch["inputs"].shape[0]
    loss, tokens, ev = losses(dataclasses.replace(exp.step_options, objective=PerRow()))
    assert tokens == mask.sum()  # the tokens trained on, whatever the loss is averaged over
    np.testing.assert_allclose([loss, ev], total / rows, rtol=1e-5)
