"""Sharding rule tables: logical axis names -> mesh axes.

The model only speaks logical names ("embed", "act_batch", ...). A rule table,
plain data, decides where each goes; swapping the table changes the layout of
an experiment without touching model code.

A table is an ordered tuple of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is ``None``, one mesh axis, or a tuple of mesh axes. Resolution of
one array's names takes, for each name, the first matching pair; mesh axes of
size 1 are dropped, and a mesh axis already used by an earlier dimension of the
same array is dropped too (an array can be split along one mesh axis once).

Storage vs compute (as in Levanter): parameters are *stored* sharded by the
table (FSDP shards them over the data axes), and *used* with the data axes
removed, i.e. gathered just in time inside each layer. The data axes are the
mesh axes that split the batch and the sequence (``act_batch``, ``act_seq``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ndjax.errors import ConfigError
from ndjax.mesh import AXES

MeshAxes = None | str | tuple[str, ...]
Table = tuple[tuple[str, MeshAxes], ...]

# Activation names carry an ``act_`` prefix so that parameters and activations
# with the same meaning can be laid out differently.
_ACTIVATIONS: Table = (
    ("act_batch", ("replica", "fsdp")),
    ("act_seq", "context"),          # sequence inside attention / MLP
    ("act_res_seq", "context"),      # sequence of the residual stream between blocks
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
_PARAMS: Table = (
    ("layers", None),
    ("vocab", "tensor"),              # vocab-parallel embedding and LM head
    ("embed", ("fsdp", "context")),   # FSDP over Accelerate's dp_shard x cp group
    ("q_heads", "tensor"),            # q/k/v column-parallel ...
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),                # gate/up column-parallel, down row-parallel
    ("norm", None),
)


def _replace(table: Table, **overrides: MeshAxes) -> Table:
    return tuple((name, overrides.get(name, axes)) for name, axes in table)


PRESETS: dict[str, Table] = {
    # Batch over replica x fsdp, parameters FSDP-sharded over fsdp x context,
    # Megatron tensor parallelism over tensor.
    "default": _ACTIVATIONS + _PARAMS,
    # Megatron sequence parallelism: the residual stream between blocks (norms,
    # residual adds) is also split over tensor along the sequence, turning the
    # TP all-reduces into reduce-scatter + all-gather pairs.
    "megatron_sp": _replace(_ACTIVATIONS, act_res_seq=("context", "tensor")) + _PARAMS,
    # ZeRO-3 across replicas too: parameters and optimizer state are sharded
    # over every data axis (less memory, gathers cross the replica axis).
    "zero3_everywhere": _ACTIVATIONS + _replace(_PARAMS, embed=("replica", "fsdp", "context")),
}

DATA_NAMES = ("act_batch", "act_seq")


def get_table(spec: str | Sequence) -> Table:
    """A preset name or a table -> a checked table."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(
                f"rules={spec!r} is not a preset; choose one of {sorted(PRESETS)} "
                "or give a full table of (logical_name, mesh_axes) pairs.")
        return PRESETS[spec]
    table = []
    for entry in spec:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2
                and isinstance(entry[0], str)):
            raise ConfigError(
                f"rules: entry {entry!r} is not a (logical_name, mesh_axes) pair.")
        name, axes = entry
        axes_t = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes_t if a not in AXES]
        if unknown:
            raise ConfigError(
                f"rules: {name!r} maps to unknown mesh axes {unknown}; mesh axes are {AXES}.")
        table.append((name, None if axes is None else axes if isinstance(axes, str)
                      else tuple(axes)))
    return tuple(table)


def format_table(table: Table) -> str:
    return "\n".join(f"  {name:<14} -> {axes}" for name, axes in table)


class Rules:
    """A rule table bound to a mesh: resolves logical names to specs."""

    def __init__(self, table: str | Sequence, mesh: Mesh):
        self.table = get_table(table)
        self.mesh = mesh
        self._lookup: dict[str, MeshAxes] = {}
        for name, axes in self.table:
            self._lookup.setdefault(name, axes)
        self.data_axes = frozenset(
            a for n in DATA_NAMES if n in self._lookup for a in self.axes_of(n))

    def axes_of(self, name: str) -> tuple[str, ...]:
        if name not in self._lookup:
            raise ConfigError(
                f"logical axis {name!r} has no rule in the sharding table; add a "
                f"({name!r}, mesh_axes) pair. The table is:\n{format_table(self.table)}")
        axes = self._lookup[name]
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    def spec(self, names: Sequence[str | None], *,
             drop: frozenset[str] = frozenset()) -> PartitionSpec:
        """PartitionSpec for an array whose dimensions have these logical names."""
        used: set[str] = set(drop)
        out = []
        for name in names:
            axes = () if name is None else tuple(a for a in self.axes_of(name) if a not in used)
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while out and out[-1] is None:
            out.pop()
        return PartitionSpec(*out)

    def sharding(self, names: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def kv_repeat(self, n_kv_heads: int) -> int:
        """How many tensor shards share each kv head: 1 when the kv heads split evenly
        over their mesh axes; ways / n_kv_heads when those axes are a multiple of the
        kv heads (MQA, or GQA on a wide tensor axis). Then the kv weights are stored
        replicated over those axes and repeated at use, so that each shard holds the
        kv head its query heads attend with (as Megatron-LM and MaxText do)."""
        ways = math.prod(self.mesh.shape[a] for a in self.axes_of("kv_heads"))
        if n_kv_heads % ways and ways % n_kv_heads == 0:
            return ways // n_kv_heads
        return 1

    def stored_names(self, names: Sequence[str | None], n_kv_heads: int
                     ) -> tuple[str | None, ...]:
        """A parameter's logical names for its storage layout: ``names``, with the kv
        heads left unsplit when they are replicated (``kv_repeat`` > 1)."""
        if self.kv_repeat(n_kv_heads) == 1:
            return tuple(names)
        return tuple(None if n == "kv_heads" else n for n in names)

    def compute_spec(self, names: Sequence[str | None]) -> PartitionSpec:
        """Spec of a parameter while it is used: gathered over the data axes."""
        return self.spec(names, drop=self.data_axes)


def check_divisible(spec: PartitionSpec, shape: Sequence[int], names: Sequence[str | None],
                    mesh: Mesh, what: str, labels: dict[str, str] | None = None) -> None:
    """Raises ConfigError if a dimension cannot be split evenly as ``spec`` asks."""
    for i, axes in enumerate(spec):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        ways = math.prod(mesh.shape[a] for a in axes)
        if shape[i] % ways:
            name = names[i]
            field = f"{labels[name]}={shape[i]}" if labels and name in labels else (
                f"size {shape[i]}")
            raise ConfigError(
                f"{field} ({what}, dimension {i}, logical axis {name!r}) cannot be split "
                f"{ways} ways over mesh axes {' x '.join(f'{a}({mesh.shape[a]})' for a in axes)}. "
                f"Change the model so that {ways} divides it, use a smaller mesh degree, or "
                f"map {name!r} to other mesh axes in the rule table.")


_ACTIVE: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("ndjax_rules", default=None)


def active() -> Rules | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def use(rules: Rules) -> Iterator[Rules]:
    """Makes ``rules`` the active table and its mesh the active mesh.

    Trace and run the step inside this context: logical constraints need both,
    and without ``jax.set_mesh`` a bare PartitionSpec constraint has no mesh.
    """
    token = _ACTIVE.set(rules)
    try:
        with jax.set_mesh(rules.mesh):
            yield rules
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation, by logical names.

    A no-op when no rules are active (single-device reference runs, shape
    inference); the train step is always traced inside ``use(...)``.
    """
    rules = _ACTIVE.get()
    if rules is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for a {x.ndim}-d array")
    return jax.lax.with_sharding_constraint(x, rules.spec(names))


def constrain_param(w: jax.Array, names: Sequence[str | None], dtype=None) -> jax.Array:
    """A parameter at its point of use: cast to ``dtype``, then moved from its storage
    layout to its compute layout.

    Forward, the weight is cast while still sharded and then gathered over the data
    axes, so FSDP's all-gather moves compute-dtype bytes (bfloat16: half of float32's).
    Backward (``_gather_vjp``), the cotangent is cast to float32 *before* it is
    reduce-scattered back to the storage layout, right here inside the layer loop:
    gradients are summed across devices in float32 and never accumulated unsharded
    across layers.
    """
    dtype = w.dtype if dtype is None else jnp.dtype(dtype)
    rules = _ACTIVE.get()
    if rules is None:
        return w.astype(dtype)
    storage = NamedSharding(rules.mesh, rules.spec(names))
    compute = NamedSharding(rules.mesh, rules.compute_spec(names))
    return _cast_and_gather(w, storage, compute, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_and_gather(w, storage, compute, dtype):
    # Gather in the narrower of the two dtypes (bfloat16 parameters computed in
    # float32 are widened after the gather). The cast is pinned to the storage
    # layout too, or propagation may place it after the gather.
    narrow = dtype if jnp.dtype(dtype).itemsize <= w.dtype.itemsize else w.dtype
    w = jax.lax.with_sharding_constraint(w.astype(narrow), storage)
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(w, compute)
                                            .astype(dtype), compute)


def _gather_fwd(w, storage, compute, dtype):
    # No residual but the parameter's dtype, carried by an empty array.
    return _cast_and_gather(w, storage, compute, dtype), jnp.zeros((0,), w.dtype)


def _gather_vjp(storage, compute, dtype, dtype_of_w, g):
    g = jax.lax.with_sharding_constraint(g.astype(jnp.float32), compute)
    return (jax.lax.with_sharding_constraint(g, storage).astype(dtype_of_w.dtype),)


_cast_and_gather.defvjp(_gather_fwd, _gather_vjp)
