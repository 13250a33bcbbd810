"""Shard your own Flax NNX model with ndjax: a small MLP classifier, FSDP x TP on 8 devices.

    python examples/shard_your_model.py

On a CPU-only host it simulates 8 devices. The parameters name their dimensions
(``logical_axes``); ndjax's default rule table puts ``embed`` on fsdp and ``mlp``
on tensor, and one rule of our own keeps the classes whole.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ndjax import ParallelismConfig, make_train_step, shard_model
from ndjax.parallel.rules import PRESETS, constrain

RULES = PRESETS["default"] + (("classes", None),)
FEATURES, HIDDEN, CLASSES = 32, 128, 16


def linear(d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, rngs=rngs, kernel_metadata={"logical_axes": names},
                      bias_metadata={"logical_axes": names[1:]})


class MLP(nnx.Module):
    """Residual MLP block (column- then row-parallel over tensor) and a classifier head."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = linear(FEATURES, HIDDEN, ("embed", "mlp"), rngs)
        self.down = linear(HIDDEN, FEATURES, ("mlp", "embed"), rngs)
        self.head = linear(FEATURES, CLASSES, ("embed", "classes"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(self.up(x)), ("act_batch", "act_mlp"))
        x = constrain(x + self.down(h), ("act_batch", "act_embed"))
        return self.head(x)


def loss_fn(model: MLP, batch: dict) -> jax.Array:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batch(key: jax.Array, rows: int = 64) -> dict:
    """Inputs with labels from a fixed random teacher: learnable, no files needed."""
    teacher = jax.random.normal(jax.random.key(42), (FEATURES, CLASSES))
    x = jax.random.normal(key, (rows, FEATURES))
    return {"x": x, "y": jnp.argmax(x @ teacher, axis=-1)}


def main(steps: int = 8) -> list[float]:
    mesh = ParallelismConfig(dp_shard_size=4, tp_size=2).build_mesh()
    model = shard_model(lambda: MLP(nnx.Rngs(0)), mesh, RULES)
    print("up.kernel", model.up.kernel[...].sharding.spec, "on", dict(mesh.shape))
    step = make_train_step(loss_fn, optax.adamw(1e-2), model, mesh, RULES)
    state = step.init(model)
    losses = []
    for i in range(steps):
        state, metrics = step(state, make_batch(jax.random.key(i)))
        losses.append(float(metrics["loss"]))
        print(f"step {i + 1}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    # 8 simulated devices where jax runs on CPU (GPU backends ignore it). It must come
    # before jax starts its backends, so here rather than at import (tests import this).
    jax.config.update("jax_num_cpu_devices", 8)
    main()
