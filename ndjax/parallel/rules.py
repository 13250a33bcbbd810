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
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ndjax.parallel.mesh import AXES
from ndjax.runtime.errors import ConfigError

MeshAxes = None | str | tuple[str, ...]


def axes_of(x: MeshAxes) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple (none, one or several)."""
    return () if x is None else (x,) if isinstance(x, str) else tuple(x)
Table = tuple[tuple[str, MeshAxes], ...]

# Activation names carry an ``act_`` prefix so that parameters and activations
# with the same meaning can be laid out differently.
_ACTIVATIONS: Table = (
    ("act_batch", ("replica", "fsdp", "expert")),
    ("act_seq", "context"),          # sequence inside attention / MLP
    ("act_res_seq", "context"),      # sequence of the residual stream between blocks
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_experts", None),           # MoE router logits: every expert on every device
)
_PARAMS: Table = (
    ("layers", "stage"),             # pipeline stages: contiguous runs of layers
    ("dense_layers", None),          # DeepSeek V3's dense first layers: before the stages
    ("vocab", "tensor"),              # vocab-parallel embedding and LM head
    # FSDP over Accelerate's dp_shard x cp group, and the expert axis (a data axis
    # outside the experts; the experts' own weights take it for their experts first).
    ("embed", ("fsdp", "context", "expert")),
    ("q_heads", "tensor"),            # q/k/v column-parallel ...
    ("kv_heads", "tensor"),
    ("head_dim", None),
    # Multi-head latent attention's latents (ndjax.models.mla): the rows of its second
    # projections FSDP-sharded as embed's; wkv_a's outputs (the latent and the rotary
    # key) whole, as embed takes those axes first.
    ("q_lora", ("fsdp", "context", "expert")),
    ("kv_lora", ("fsdp", "context", "expert")),
    ("kv_lora_rope", None),
    ("mlp", "tensor"),                # gate/up column-parallel, down row-parallel
    ("experts", "expert"),            # MoE: the experts split over the expert axis
    ("expert_mlp", "tensor"),         # each expert's width, split as the dense MLP's
    ("norm", None),
    ("lora_rank", None),              # LoRA adapters' rank: small, never split
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
    "zero3_everywhere": _ACTIVATIONS + _replace(
        _PARAMS, **{name: ("replica", "fsdp", "context", "expert")
                    for name in ("embed", "q_lora", "kv_lora")}),
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
        """Spec of a parameter while it is used: gathered over the data axes, but for
        the axes that split the experts (a data axis elsewhere: each device computes
        its own experts)."""
        spec = self.spec(names, drop=self.data_axes)
        if "experts" not in names:
            return spec
        split = tuple(a for a in self.axes_of("experts") if a in self.data_axes)
        if not split:
            return spec
        out = list(spec) + [None] * (len(names) - len(spec))
        out[list(names).index("experts")] = split[0] if len(split) == 1 else split
        return PartitionSpec(*out)


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
# Parameters arrive already in their compute layout (``params_gathered``).
_GATHERED: contextvars.ContextVar[bool] = contextvars.ContextVar("ndjax_gathered", default=False)


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


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No active table inside: for code that runs on one device's shards (the body of
    a ``jax.shard_map``), where logical constraints and per-shard wrappers must not
    apply again."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def params_gathered() -> Iterator[None]:
    """Inside, parameters come already gathered to their compute layout (``gathered``:
    a pipeline's stages gathered once per step, not once per tick): no use gathers
    them again (``ParamUse.arrives_gathered``), and each use's gradient still goes to
    the storage layout, summed in float32 across the data axes."""
    token = _GATHERED.set(True)
    try:
        yield
    finally:
        _GATHERED.reset(token)


def gathered(value: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """A stored parameter with these logical names in its compute layout, in its own
    dtype (``params_gathered``'s input). Its gradient is constrained to the storage
    layout, where the uses inside hand theirs: the sum over the uses stays there
    rather than being gathered back."""
    rules = _ACTIVE.get()
    if rules is None:
        return value
    names = tuple(names)
    return _gather_once(value, NamedSharding(rules.mesh, rules.spec(names)),
                        NamedSharding(rules.mesh, rules.compute_spec(names)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_once(value: jax.Array, storage: NamedSharding, compute: NamedSharding
                 ) -> jax.Array:
    return jax.lax.with_sharding_constraint(value, compute)


def _gather_once_fwd(value, storage, compute):
    return _gather_once(value, storage, compute), None


def _gather_once_bwd(storage, compute, _, g):
    return (jax.lax.with_sharding_constraint(g, storage),)


_gather_once.defvjp(_gather_once_fwd, _gather_once_bwd)


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


@dataclasses.dataclass(frozen=True)
class ParamUse:
    """How a parameter goes from its storage layout to its point of use, and how its
    gradient comes back: static (hashable), for the custom VJPs of the ops that use
    weights (``layers.project``, ``layers.embed_lookup``, the LM head in
    ``ops.cross_entropy``).

    Forward (``gather``): cast to ``dtype`` while still sharded (``storage``), so
    FSDP's all-gather moves compute-dtype bytes (bfloat16: half of float32's),
    then gathered over the data axes (``gathered``) and, for kv weights stored
    replicated (``Rules.kv_repeat``), each kv head repeated ``repeat`` times along
    dimension ``axis`` into ``compute``.

    Backward (``scatter``): the op that uses the gathered weight takes the stored
    one as an argument too, forms the weight's gradient in float32 from its
    per-device partial sums and hands it here unrounded, as the stored weight's
    gradient (the gathered one gets none); it is constrained to
    ``storage`` in float32, so the partitioner sums it across the data axes with a
    reduce-scatter (each device receives only its shard, summed in float32), and
    it is cast to the parameter's dtype only after. Rounding it to the compute
    dtype first (the gradient of a bfloat16 gathered weight) would force the
    partitioner to finish the sum before the rounding: an all-reduce of the whole
    gradient, sliced afterwards, twice a reduce-scatter's bytes.

    ``arrives_gathered`` (``params_gathered``): the value comes already in the
    ``gathered`` layout, in its own dtype; the forward casts it there, and the
    gradient still goes to ``storage``.

    The shardings are None when no rules are active (one device, shape inference).
    """

    dtype: Any
    storage: NamedSharding | None = None
    gathered: NamedSharding | None = None
    compute: NamedSharding | None = None
    repeat: int = 1
    axis: int = 0
    arrives_gathered: bool = False

    @property
    def T(self) -> ParamUse:  # noqa: N802 (as jax.Array.T)
        """The use of a 2-d parameter's transpose (the LM head of tied embeddings)."""
        if self.repeat != 1:
            raise ValueError("ParamUse.T: a repeated (kv) weight has no transpose use")

        def t(s):
            if s is None:
                return None
            spec = tuple(s.spec) + (None,) * (2 - len(s.spec))
            return NamedSharding(s.mesh, PartitionSpec(*spec[::-1]))
        return ParamUse(self.dtype, t(self.storage), t(self.gathered), t(self.compute),
                        arrives_gathered=self.arrives_gathered)


def param_use(names: Sequence[str | None], dtype, n_kv_heads: int | None = None) -> ParamUse:
    """The ``ParamUse`` of a parameter with these logical names under the active rules,
    used in ``dtype``. ``n_kv_heads`` (the k/v weights): when the rules put more
    tensor shards than kv heads, the weight is stored replicated along its kv heads
    (``Rules.stored_names``) and each head is repeated at use, so that every tensor
    shard gets the one its query heads use."""
    dtype = jnp.dtype(dtype)
    rules = _ACTIVE.get()
    if rules is None:
        return ParamUse(dtype)
    repeat = 1 if n_kv_heads is None else rules.kv_repeat(n_kv_heads)
    stored = tuple(names) if repeat == 1 else rules.stored_names(names, n_kv_heads)
    sharding = functools.partial(NamedSharding, rules.mesh)
    return ParamUse(dtype, sharding(rules.spec(stored)), sharding(rules.compute_spec(stored)),
                    sharding(rules.compute_spec(names)), repeat,
                    list(names).index("kv_heads") if repeat > 1 else 0, _GATHERED.get())


def _constrain_to(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def gather(w: jax.Array, use: ParamUse) -> jax.Array:
    """A stored parameter in its compute layout and dtype (forward; see ``ParamUse``).

    Differentiating through it would round the weight's gradient to the compute
    dtype before it is summed across devices: the ops that use a gathered weight
    take the stored one too and give their gradient to it (``scatter``) instead.
    """
    # Gather in the narrower of the two dtypes (bfloat16 parameters computed in
    # float32 are widened after the gather). The cast is pinned to the storage
    # layout too, or propagation may place it after the gather.
    if use.arrives_gathered:
        w = _constrain_to(w.astype(use.dtype), use.gathered)
    else:
        narrow = use.dtype if use.dtype.itemsize <= w.dtype.itemsize else w.dtype
        w = _constrain_to(w.astype(narrow), use.storage)
        w = _constrain_to(_constrain_to(w, use.gathered).astype(use.dtype), use.gathered)
    if use.repeat == 1:
        return w
    return _constrain_to(jnp.repeat(w, use.repeat, axis=use.axis), use.compute)


def scatter(g: jax.Array, use: ParamUse, dtype) -> jax.Array:
    """The gradient ``g`` (float32, compute layout, possibly still a per-device partial
    sum) of ``gather(w, use)`` -> the gradient of ``w``: in its storage layout, summed
    in float32, then cast to ``dtype`` (the parameter's)."""
    g = g.astype(jnp.float32)
    if use.repeat > 1:  # transpose of jnp.repeat: sum each head's copies
        k = use.axis
        g = g.reshape(*g.shape[:k], g.shape[k] // use.repeat, use.repeat, *g.shape[k + 1:])
        g = jnp.sum(g, axis=k + 1)
    return _constrain_to(g, use.storage).astype(dtype)


def data_axes(rules: Rules) -> tuple[str, ...]:
    """The data axes (size > 1) in mesh order: a shard_map's manual axes for per-device
    work on each device's rows and sequence."""
    return tuple(a for a in rules.mesh.axis_names if a in rules.data_axes)


def _split_data_axes(use: ParamUse, axes: tuple[str, ...]
                     ) -> tuple[tuple[str, ...], tuple[str, ...], tuple]:
    """(the data axes that do not shard the parameter, those that do, its storage spec)."""
    spec = tuple(use.storage.spec) if use.storage is not None else ()
    sharding = {a for s in spec for a in ((s,) if isinstance(s, str) else s or ())}
    return (tuple(a for a in axes if a not in sharding),
            tuple(a for a in axes if a in sharding), spec)


def _in_map(use: ParamUse) -> bool:
    """Whether a partial gradient is summed inside the shard_map (``psum_scatter``):
    only when its compute layout splits it over no mesh axis, for XLA gathers a
    ``psum_scatter``'s operand over the axes the shard_map leaves to the partitioner
    (tensor) first. Otherwise the partial sums leave the shard_map stacked and are
    summed outside, which costs a stacked buffer of temporaries (1.75 MiB of the
    tiny fsdp=8 step's head and table, hence not always)."""
    return use.compute is None or not any(use.compute.spec)


def _data_dims(spec: tuple, axes: tuple[str, ...], ndim: int) -> list[tuple[str, ...]]:
    spec = spec + (None,) * (ndim - len(spec))
    return [tuple(a for a in ((s,) if isinstance(s, str) else s or ()) if a in axes)
            for s in spec]


def partials_spec(use: ParamUse, axes: tuple[str, ...], ndim: int) -> PartitionSpec:
    """Out_spec, in a shard_map over the data axes ``axes``, of ``partials_out``'s result
    for a parameter of ``ndim`` dimensions."""
    rest, shard, spec = _split_data_axes(use, axes)
    if _in_map(use):
        return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d
                               for d in _data_dims(spec, axes, ndim)))
    return PartitionSpec(*stacked_lead(use, axes), *(None,) * ndim)


def stacked_lead(use: ParamUse, axes: tuple[str, ...]) -> tuple:
    """The leading dimensions of one value per device of the data axes ``axes`` for a
    parameter used as ``use`` (its partial gradients, ``stacked_sum``): one per data
    axis that does not shard the parameter, then one over those that do."""
    rest, shard, _ = _split_data_axes(use, axes)
    return (*rest, shard) if shard else rest


def stacked_sum(out: jax.Array, use: ParamUse, axes: tuple[str, ...], dtype) -> jax.Array:
    """Per-device partial gradients stacked along ``stacked_lead(use, axes)`` -> the
    parameter's gradient in its storage layout, summed in float32 (a reduce-scatter
    over the data axes that shard it, then an all-reduce over the others), cast to
    ``dtype``."""
    rest, shard, spec = _split_data_axes(use, axes)
    g = out.astype(jnp.float32)
    if shard:
        g = jnp.sum(g, axis=len(rest))
        if use.storage is not None:
            ndim = g.ndim - len(rest)
            g = jax.lax.with_sharding_constraint(g, NamedSharding(
                use.storage.mesh, PartitionSpec(*rest, *spec, *(None,) * (ndim - len(spec)))))
    return scatter(jnp.sum(g, axis=tuple(range(len(rest)))), use, dtype)


def partials_out(g: jax.Array, use: ParamUse, axes: tuple[str, ...]) -> jax.Array:
    """Inside a shard_map over the data axes ``axes``: this device's partial gradient
    ``g`` (float32, the parameter's compute shape), either summed over ``axes``
    into the storage layout (a reduce-scatter over the axes that shard it, an
    all-reduce over the others), or stacked for ``partials_sum`` (``_in_map``)."""
    rest, shard, spec = _split_data_axes(use, axes)
    if not _in_map(use):
        return g.reshape((1,) * (len(rest) + bool(shard)) + g.shape)
    for dim, over in enumerate(_data_dims(spec, axes, g.ndim)):
        if over:
            g = jax.lax.psum_scatter(g, over, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, rest) if rest else g


def partials_sum(out: jax.Array, use: ParamUse, axes: tuple[str, ...], dtype) -> jax.Array:
    """``partials_out``'s result, out of the shard_map -> the parameter's gradient in its
    storage layout, cast to ``dtype``. Stacked partial sums are summed in float32,
    first over the data axes that shard the parameter (the partitioner makes that a
    reduce-scatter; one stacked dimension per axis would make it sum them one after
    the other, all-reducing the whole gradient over the first), then over the
    others (an all-reduce of the shard, HSDP's replicas)."""
    if _in_map(use):
        return scatter(out, use, dtype)
    return stacked_sum(out, use, axes, dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["gathered", "value"],
                   meta_fields=["use"])
@dataclasses.dataclass(frozen=True)
class Weight:
    """A parameter at its point of use: ``gathered`` (``gather(value, use)``, what the
    op computes with) and the stored ``value`` (what its gradient goes to), for an op
    outside the model's modules (the LM head, in the chunked loss)."""

    gathered: jax.Array
    value: jax.Array
    use: ParamUse

    @property
    def T(self) -> Weight:  # noqa: N802 (as jax.Array.T)
        return Weight(self.gathered.T, self.value.T, self.use.T)
