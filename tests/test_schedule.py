"""train.schedule against the transformers schedules it stands for (the ones Axolotl
runs, which ndjax from_axolotl maps to it): the learning rate of every step, ndjax's in
float32 from the jitted schedule, transformers' from torch's LambdaLR stepped as its
Trainer steps it (once per optimizer step, the first step at lr_lambda(0))."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import optimization as hf

from ndjax.config import Settings, default_config
from ndjax.step.state import make_schedule

LR = 2e-4


def ndjax_rates(schedule: str, steps: int, warmup: int, upto: int, **train) -> np.ndarray:
    """The rate of steps 0..upto, as the train step sees it (an int32 count, jitted)."""
    c = default_config()
    c.train.update(dict(lr=LR, steps=steps, warmup_steps=warmup, schedule=schedule, **train))
    rate = jax.jit(make_schedule(Settings.parse(c).train))
    got = np.array([rate(jnp.int32(k)) for k in range(upto + 1)])
    assert got.dtype == np.float32
    return got


def transformers_rates(make, upto: int, **kwargs) -> np.ndarray:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = make(optimizer, **kwargs)
    rates = []
    for _ in range(upto + 1):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return np.array(rates)


@pytest.mark.parametrize("steps, warmup", [(100, 10), (100, 0), (37, 5), (20, 20), (10, 15)])
def test_linear_is_transformers_linear_schedule_with_warmup(steps, warmup):
    """Up from 0 over the warmup, down to 0 at train.steps, 0 after (a run resumed past
    its steps): every step to float32's rounding, the last ones (a few ulps of lr away
    from 0) included."""
    upto = steps + 5
    want = transformers_rates(hf.get_linear_schedule_with_warmup, upto,
                              num_warmup_steps=warmup, num_training_steps=steps)
    got = ndjax_rates("linear", steps, warmup, upto)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert not got[max(steps, warmup):].any()  # the tail, compared too: clamped at 0


# The cosines run through optax's jnp.cos, whose float32 result near the end of the
# decay (1 + cos(pi x) as x -> 1) keeps absolute, not relative, precision: compared to
# within 1e-6 of the peak rate.
@pytest.mark.parametrize("steps, warmup", [(100, 10), (40, 0)])
def test_cosine_is_transformers_cosine_to_zero(steps, warmup):
    """train.schedule=cosine with min_lr_ratio 0 is transformers' cosine (Axolotl's
    lr_scheduler: cosine without cosine_min_lr_ratio)."""
    want = transformers_rates(hf.get_cosine_schedule_with_warmup, steps,
                              num_warmup_steps=warmup, num_training_steps=steps)
    got = ndjax_rates("cosine", steps, warmup, steps, min_lr_ratio=0.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * LR)


def test_cosine_with_a_floor_is_transformers_cosine_with_min_lr():
    """train.min_lr_ratio is transformers' cosine_with_min_lr's min_lr_rate (and
    Axolotl's cosine_min_lr_ratio under lr_scheduler: cosine, the same formula)."""
    steps, warmup, floor = 60, 6, 0.1
    want = transformers_rates(hf.get_cosine_with_min_lr_schedule_with_warmup, steps,
                              num_warmup_steps=warmup, num_training_steps=steps,
                              min_lr_rate=floor)
    got = ndjax_rates("cosine", steps, warmup, steps, min_lr_ratio=floor)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * LR)
    assert got[-1] == pytest.approx(floor * LR, rel=1e-6)


def test_constant_with_warmup_is_transformers_constant_schedule_with_warmup():
    want = transformers_rates(hf.get_constant_schedule_with_warmup, 30, num_warmup_steps=8)
    np.testing.assert_allclose(ndjax_rates("constant", 30, 8, 30), want, rtol=1e-6, atol=0)
