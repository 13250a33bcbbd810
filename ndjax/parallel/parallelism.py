"""Hugging Face Accelerate's ``ParallelismConfig`` names for ndjax's mesh degrees.

Accelerate (``accelerate.ParallelismConfig``) and ndjax split devices the same
four ways, and ndjax a fifth (``ep_size``, Axolotl's ``expert_parallel_size``:
Accelerate has none); only the names differ:

==================  ================  =====================================
Accelerate          ndjax             what it splits
==================  ================  =====================================
dp_replicate_size   ``mesh.replica``  the batch; parameters replicated (DDP/HSDP's outer axis)
dp_shard_size       ``mesh.fsdp``     the batch; parameters sharded (FSDP)
ep_size             ``mesh.expert``   a mixture of experts' experts; the batch elsewhere
cp_size             ``mesh.context``  the sequence (context parallelism)
tp_size             ``mesh.tensor``   heads and MLP width (Megatron tensor parallelism)
==================  ================  =====================================

As in Accelerate, parameters are sharded over the dp_shard x cp group (ndjax's
default rule table puts ``embed`` on ``fsdp, context``). Accelerate's sizes
default to 1 (None reads an environment variable set by ``accelerate launch``;
here None is 1: ndjax has no launcher that sets them). One size may be -1, an
ndjax extension: it takes the devices the others leave.

Of Accelerate's handlers, ``cp_handler.cp_comm_strategy`` has an ndjax meaning
(``model.cp_impl``: ring or all-to-all); the others are refused with an error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from ndjax.parallel.mesh import ParallelDims, build_mesh
from ndjax.runtime.errors import ConfigError

# mesh axis -> the field that sets it, for errors in the user's names.
FIELDS = {"replica": "dp_replicate_size", "fsdp": "dp_shard_size", "expert": "ep_size",
          "context": "cp_size", "tensor": "tp_size"}
# Accelerate's cp_comm_strategy (and ndjax's own names) -> model.cp_impl. Accelerate's
# default, "allgather" (every shard gathers all keys and values), has no ndjax kernel.
CP_STRATEGIES = {"ring": "ring", "alltoall": "all_to_all", "all_to_all": "all_to_all",
                 "auto": "auto"}


@dataclasses.dataclass(frozen=True)
class ContextParallelConfig:
    """ndjax's stand-in for Accelerate's ``TorchContextParallelConfig``, for
    ``ParallelismConfig.cp_handler``: how the context shards meet in attention.

    ``cp_comm_strategy``: ``"ring"`` (key/value blocks passed around the context
    axis), ``"alltoall"`` (sequence shards swapped for head shards around a
    one-shard kernel; ``"all_to_all"`` too) or ``"auto"``/None (ndjax decides:
    ``ndjax.ops.attention.choose``). Accelerate's own object works as well: only
    its ``cp_comm_strategy`` is read.
    """

    cp_comm_strategy: str | None = None


def _cp_impl(handler: Any) -> str | None:
    """``cp_handler`` -> ``model.cp_impl``, or None to leave the config's."""
    if handler is None:
        return None
    if not hasattr(handler, "cp_comm_strategy"):
        raise ConfigError(
            f"cp_handler={handler!r} has no cp_comm_strategy; pass "
            "ndjax.ContextParallelConfig(cp_comm_strategy='ring' or 'alltoall').")
    strategy = handler.cp_comm_strategy
    if strategy is None:
        return None
    if strategy not in CP_STRATEGIES:
        raise ConfigError(
            f"cp_handler.cp_comm_strategy={strategy!r} has no ndjax kernel; use 'ring' "
            "(key/value blocks passed around the context axis), 'alltoall' (sequence shards "
            "swapped for head shards) or 'auto'.")
    return None if strategy == "auto" else CP_STRATEGIES[strategy]


def _check_tp_handler(handler: Any) -> None:
    """Accelerate's ``TorchTensorParallelConfig`` holds only ``enable_async_tp``."""
    if handler is None:
        return
    if not hasattr(handler, "enable_async_tp"):
        raise ConfigError(f"tp_handler={handler!r} has no ndjax meaning; leave tp_handler unset.")
    if handler.enable_async_tp:
        raise ConfigError(
            "tp_handler.enable_async_tp=True has no ndjax meaning: XLA schedules tensor "
            "parallelism's collectives itself. Set enable_async_tp=False or leave tp_handler "
            "unset.")


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """Mesh degrees in Accelerate's names: ``dp_replicate_size`` -> replica,
    ``dp_shard_size`` -> fsdp, ``cp_size`` -> context, ``tp_size`` -> tensor, and
    ``ep_size`` -> expert (ndjax's; Accelerate has no expert axis).

    Each size is an int >= 1 (None: 1, as Accelerate without its launcher), or -1
    for one of them: the devices the others leave. Checked on construction, and
    against the device count by ``resolve`` and ``build_mesh``; a bad value is a
    one-line ``ConfigError`` naming the field, the value and a fix.

    ``cp_handler``: how context shards meet (``ContextParallelConfig``, or
    Accelerate's ``TorchContextParallelConfig``); ``apply_to`` writes it to
    ``model.cp_impl`` for ndjax's decoders. ``tp_handler``: accepted only without
    async TP.
    """

    dp_replicate_size: int | None = 1
    dp_shard_size: int | None = 1
    tp_size: int | None = 1
    cp_size: int | None = 1
    ep_size: int | None = 1
    tp_handler: Any = None
    cp_handler: Any = None

    def __post_init__(self) -> None:
        for name in FIELDS.values():
            if getattr(self, name) is None:
                object.__setattr__(self, name, 1)  # frozen: set once, here
        self.to_dims().check(FIELDS, "ParallelismConfig")
        _check_tp_handler(self.tp_handler)
        _cp_impl(self.cp_handler)

    @property
    def sizes(self) -> dict[str, int]:
        """{field: size}, in mesh order (outermost first)."""
        return {name: getattr(self, name) for name in FIELDS.values()}

    @property
    def total_size(self) -> int:
        """The number of devices these sizes take (all sizes must be known)."""
        unknown = [name for name, size in self.sizes.items() if size == -1]
        if unknown:
            raise ConfigError(
                f"ParallelismConfig: {unknown[0]}=-1 takes the remaining devices, so "
                "total_size depends on the device count; use resolve(num_devices).total_size.")
        return math.prod(self.sizes.values())

    def to_dims(self) -> ParallelDims:
        return ParallelDims(replica=self.dp_replicate_size, fsdp=self.dp_shard_size,
                            context=self.cp_size, tensor=self.tp_size, expert=self.ep_size)

    def resolve(self, num_devices: int) -> ParallelismConfig:
        """The same sizes with a -1 filled for ``num_devices``; ``ConfigError`` when
        they do not fit that many devices."""
        dims = self.to_dims().resolve(num_devices, FIELDS, "ParallelismConfig")
        return dataclasses.replace(self, dp_replicate_size=dims.replica, dp_shard_size=dims.fsdp,
                                   cp_size=dims.context, tp_size=dims.tensor,
                                   ep_size=dims.expert)

    def build_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """ndjax's mesh (``ndjax.parallel.mesh.build_mesh``: Auto axis types, tensor
        innermost) over ``devices`` (default: all of them)."""
        devices = list(jax.devices() if devices is None else devices)
        return build_mesh(self.resolve(len(devices)).to_dims(), devices)

    def apply_to(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """Sets ``config.mesh`` (and ``config.model.cp_impl`` if ``cp_handler`` says a
        strategy) from these sizes, in place; returns ``config``. The sizes are
        checked against the devices when the experiment is built, as any mesh. Sizes
        given are the layout: ``mesh.auto`` (train.py planning one) is turned off."""
        for axis, name in FIELDS.items():
            config.mesh[axis] = getattr(self, name)
        if "auto" in config.mesh:
            config.mesh.auto = False
        cp_impl = _cp_impl(self.cp_handler)
        if cp_impl is not None:
            config.model.cp_impl = cp_impl
        return config

