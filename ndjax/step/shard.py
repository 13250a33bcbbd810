"""ndjax as a library: shard your own Flax NNX model and train it with your own loss.

The model's parameters carry logical axis names, as ndjax's decoders' do::

    nnx.Param(value, logical_axes=("embed", "mlp"))
    nnx.Linear(..., kernel_metadata={"logical_axes": ("embed", "mlp")},
               bias_metadata={"logical_axes": ("mlp",)})

and a rule table (``ndjax.parallel.rules``: a preset such as ``"default"``, or a table of
``(logical_name, mesh_axes)`` pairs) maps each name to mesh axes. Then::

    mesh = ParallelismConfig(dp_shard_size=4, tp_size=2).build_mesh()
    model = shard_model(lambda: MyModel(nnx.Rngs(0)), mesh, rules)
    step = make_train_step(loss_fn, optax.adamw(1e-3), model, mesh, rules)
    state = step.init(model)
    state, metrics = step(state, batch)   # metrics: loss, grad_norm

Parameters are created already sharded (no device holds a whole copy), the
optimizer's moments are laid out like their parameters (``ndjax.step.state.state_shardings``),
gradients are constrained to the parameters' layout (the partitioner sums them
with a reduce-scatter), and the step is one ``jax.jit`` traced under the mesh and
the rules (``ndjax.parallel.rules.use``), so that ``ndjax.parallel.rules.constrain``
inside the model applies: outside them it is a no-op, and a constraint on a bare PartitionSpec
has no mesh.

This is the general part of what ``Experiment`` does for the decoder (whose step
adds the chunked LM-head loss, gradient accumulation and the gather/scatter of
``ndjax.models.layers``); ``decoder.logical_axes`` and the experiment's parameter
shardings could later come from here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ndjax.parallel import rules as rules_lib
from ndjax.runtime.errors import ConfigError
from ndjax.step import state as state_lib

M = TypeVar("M", bound=nnx.Module)
# A preset name, a table of (logical_name, mesh_axes) pairs, or a table bound to a mesh.
RulesLike = str | Sequence | rules_lib.Rules
LossFn = Callable[[Any, Any], jax.Array]  # (model, batch) -> scalar loss


def bind_rules(rules: RulesLike, mesh: Mesh) -> rules_lib.Rules:
    """``rules`` as a table bound to ``mesh`` (checked by ``ndjax.parallel.rules.get_table``)."""
    if isinstance(rules, rules_lib.Rules):
        if rules.mesh != mesh:
            raise ConfigError("rules: this Rules object is bound to another mesh; pass its "
                              "table (rules.table) or build Rules(table, mesh) for this mesh.")
        return rules
    return rules_lib.Rules(rules, mesh)


def _path(path: Sequence[Any]) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, parameters as a nested dict of arrays). Only ``nnx.Param``
    variables are trained and carried by the step; any other state (batch
    statistics, dropout's RNG streams) would silently stay at its initial value,
    so it is refused."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    for path, var in nnx.to_flat_state(rest):
        raise ConfigError(
            f"model: {_path(path)} is an nnx.{type(var).__name__}, and ndjax's train step "
            "carries nnx.Param variables only; build the model without other variables "
            "(no BatchNorm statistics, no Dropout RNG streams).")
    return graphdef, nnx.to_pure_dict(params)


def logical_axes(model: nnx.Module) -> dict:
    """Nested dict of each parameter's logical names (tuples), as ``split_params``'s
    dict; ``ConfigError`` for a parameter without them."""
    out: dict = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = var.get_metadata().get("logical_axes")
        shape = tuple(jnp.shape(var.get_value()))  # an array, or eval_shape's struct
        if names is None or len(names) != len(shape):
            raise ConfigError(
                f"parameter {_path(path)} (shape {shape}) has logical_axes="
                f"{names!r}; give it one logical name per dimension: nnx.Param(value, "
                "logical_axes=(...)) or nnx.Linear(..., kernel_metadata={'logical_axes': ...}).")
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(names)
    return out


def param_shardings(model: nnx.Module, rules: rules_lib.Rules) -> dict:
    """Where each parameter is stored: its logical names resolved by ``rules``,
    checked to split evenly (``ConfigError`` naming the parameter otherwise)."""
    shapes = split_params(model)[1]

    def one(path, shape, names):
        what = f"parameter {_path(path)}"
        try:
            spec = rules.spec(names)
        except ConfigError as e:  # a logical name the table lacks
            raise ConfigError(f"{what}: {e}") from None
        rules_lib.check_divisible(spec, shape.shape, names, rules.mesh, what)
        return NamedSharding(rules.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, shapes, logical_axes(model),
                                            is_leaf=lambda x: isinstance(x, tuple))


def shard_model(model_factory: Callable[[], M], mesh: Mesh, rules: RulesLike = "default") -> M:
    """Builds ``model_factory()`` with every parameter created in the layout the rules
    give its logical names: the factory runs once abstractly (shapes and names, no
    memory) and once inside ``jax.jit`` with sharded outputs, so no device ever
    holds a whole copy. The factory must build the model from scratch, its
    ``nnx.Rngs`` included (a captured, already used Rngs would differ between the
    two runs). Returns the model, its parameters sharded jax arrays."""
    rules = bind_rules(rules, mesh)
    abstract = nnx.eval_shape(model_factory)
    graphdef, _ = split_params(abstract)
    shardings = param_shardings(abstract, rules)

    def init() -> dict:
        return split_params(model_factory())[1]

    with rules_lib.use(rules):
        params = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, params)


def loss_and_grads(loss_fn: LossFn, graphdef: nnx.GraphDef, params: dict, batch: Any,
                   grad_shardings: Any = None) -> tuple[jax.Array, dict]:
    """(``loss_fn(model, batch)``, its gradient with respect to ``params``), the
    gradient constrained to ``grad_shardings`` (the parameters' layout) if given."""
    def loss_of(p: dict) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, p), batch)

    loss, grads = jax.value_and_grad(loss_of)(params)
    if grad_shardings is not None:
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
    return loss, grads


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """``make_train_step``'s result: ``step(state, batch) -> (state, metrics)``.

    ``state`` is an ``ndjax.step.state.TrainState`` (step, params: the model's
    parameters as a nested dict, opt_state) from ``init``; it is donated, so use
    the returned one. ``batch`` is any pytree whose leaves have the batch along
    their leading dimensions (``batch_names``): numpy arrays, or jax arrays that
    are uncommitted or already in ``batch_sharding``. ``metrics``: ``loss`` and
    ``grad_norm`` (the gradient's global norm), replicated.
    """

    optimizer: optax.GradientTransformation
    graphdef: nnx.GraphDef
    rules: rules_lib.Rules
    batch_names: tuple[str | None, ...]
    state_sharding: state_lib.TrainState
    _jitted: Callable = dataclasses.field(repr=False)

    @property
    def mesh(self) -> Mesh:
        return self.rules.mesh

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.rules.sharding(self.batch_names)

    def init(self, model: nnx.Module) -> state_lib.TrainState:
        """Step 0 for ``model`` (``shard_model``'s, or any model of the same graph):
        its parameters moved to their layout if they are not in it, the optimizer
        state created already sharded.

        The state takes the model's parameter arrays as they are (no copy), and the
        step donates its state: after the first step, ``model``'s arrays are deleted
        and ``self.model(state)`` is the trained model."""
        graphdef, params = split_params(model)
        if graphdef != self.graphdef:
            raise ConfigError("TrainStep.init: this model's structure differs from the one "
                              "make_train_step was given; build the step for this model.")
        params = jax.device_put(params, self.state_sharding.params)
        with rules_lib.use(self.rules):
            opt_state = jax.jit(self.optimizer.init,
                                out_shardings=self.state_sharding.opt_state)(params)
        step = jax.device_put(state_lib.zero_step(), self.state_sharding.step)
        return state_lib.TrainState(step=step, params=params, opt_state=opt_state)

    def model(self, state: state_lib.TrainState) -> nnx.Module:
        """The model with ``state``'s parameters (for evaluation)."""
        return nnx.merge(self.graphdef, state.params)

    def __call__(self, state: state_lib.TrainState, batch: Any
                 ) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
        self.check_batch(batch)
        # Traced (on the first call) and run under the mesh and the rules: the model's
        # logical constraints need both, and are dropped without them.
        with rules_lib.use(self.rules):
            return self._jitted(state, batch)

    def lower(self, state: state_lib.TrainState, batch: Any) -> jax.stages.Lowered:
        """The step lowered as ``__call__`` traces it (for its HLO, or ``.compile()``'s
        memory and cost analyses)."""
        self.check_batch(batch)
        with rules_lib.use(self.rules):
            return self._jitted.lower(state, batch)

    def check_batch(self, batch: Any) -> None:
        """``ConfigError`` for a batch leaf the data axes cannot split evenly."""
        spec = tuple(self.rules.spec(self.batch_names))
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            shape = tuple(jnp.shape(leaf))
            if len(shape) < len(self.batch_names):
                raise ConfigError(
                    f"batch {_path(path)}: shape {shape} has fewer dimensions than "
                    f"batch_names={self.batch_names}; every leaf leads with the batch.")
            for dim, (size, axes) in enumerate(zip(shape, spec)):
                axes = rules_lib.axes_of(axes)
                ways = math.prod(self.mesh.shape[a] for a in axes)
                if size % ways:
                    raise ConfigError(
                        f"batch {_path(path)}: dimension {dim} ({self.batch_names[dim]!r}) has "
                        f"size {size}, which {ways} = "
                        f"{' x '.join(f'{a}({self.mesh.shape[a]})' for a in axes)} cannot "
                        f"split evenly; use a multiple of {ways}, e.g. "
                        f"{(size // ways + 1) * ways}.")


def _step(loss_fn: LossFn, optimizer: optax.GradientTransformation, graphdef: nnx.GraphDef,
          grad_shardings: Any, state: state_lib.TrainState, batch: Any
          ) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
    loss, grads = loss_and_grads(loss_fn, graphdef, state.params, batch, grad_shardings)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return state_lib.TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    model: nnx.Module, mesh: Mesh, rules: RulesLike = "default", *,
                    batch_names: Sequence[str | None] = ("act_batch",)) -> TrainStep:
    """A jitted train step for ``model`` (its graph and parameter layout; usually
    ``shard_model``'s) and ``loss_fn(model, batch) -> scalar`` with ``optimizer``
    (any optax transformation).

    ``batch_names``: logical names of the batch leaves' leading dimensions; the
    default splits the first over the rules' ``act_batch`` axes (replica x fsdp in
    the default table) and leaves the rest whole. The shardings of the whole state
    are fixed here, so a step never moves parameters or moments between devices.
    """
    rules = bind_rules(rules, mesh)
    graphdef, params = split_params(model)
    shardings = param_shardings(model, rules)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sharding = state_lib.state_shardings(optimizer, shapes, shardings, replicated)
    batch_names = tuple(batch_names)
    step = jax.jit(
        lambda state, batch: _step(loss_fn, optimizer, graphdef, shardings, state, batch),
        in_shardings=(state_sharding, rules.sharding(batch_names)),
        out_shardings=(state_sharding, replicated), donate_argnums=0)
    return TrainStep(optimizer, graphdef, rules, batch_names, state_sharding, step)
