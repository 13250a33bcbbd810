"""The device mesh: six named axes, validated degrees, hybrid layout across hosts.

Axis order is ``stage, replica, fsdp, expert, context, tensor`` from outermost to
innermost (``stage`` splits the layers into pipeline stages,
``ndjax.parallel.pipeline``; ``expert`` splits a mixture of experts' experts, and is
one more data axis for everything else).
Devices that are neighbours in ``jax.devices()`` (same node, fast NVLink) end up
on the innermost axes, so the chattiest collectives stay inside a node:
tensor parallelism all-reduces activations in every layer, context parallelism
passes key/value blocks around its ring in every attention call, while FSDP
gathers weights once per layer and replicas only all-reduce gradients once per
step; pipeline stages only pass activations to their neighbours. Across processes
(slow network) ``stage``, ``replica`` and ``fsdp`` are split first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from ndjax.runtime.errors import ConfigError

AXES: tuple[str, ...] = ("stage", "replica", "fsdp", "expert", "context", "tensor")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of the mesh axes. At most one may be -1 ("the rest"). ``expert`` and
    ``stage`` come last among the fields (positional calls name the other four), not
    in ``AXES``' order."""

    replica: int = 1
    fsdp: int = -1
    context: int = 1
    tensor: int = 1
    expert: int = 1
    stage: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def check(self, labels: Mapping[str, str] | None = None, where: str = "mesh") -> None:
        """The checks that need no device count: each degree an int >= 1 or -1, and at
        most one -1. Raises ``ConfigError`` naming the field and a fix.

        ``labels`` maps each axis to the field that set it (default ``mesh.<axis>``)
        and ``where`` names the whole, so that callers with other names for the same
        degrees (``ndjax.parallel.parallelism.ParallelismConfig``) get errors in their names.
        """
        field = _fields(labels)
        for axis, size in zip(AXES, self.sizes):
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
                raise ConfigError(
                    f"{field[axis]}={size!r} must be an int (a degree >= 1, or -1 for "
                    "'all remaining devices')")
            if size < 1 and size != -1:
                raise ConfigError(
                    f"{field[axis]}={size} must be >= 1, or -1 for 'all remaining devices'")
        fill = [a for a, s in zip(AXES, self.sizes) if s == -1]
        if len(fill) > 1:
            raise ConfigError(
                f"{where}: {', '.join(field[a] for a in fill)} are all -1; at most one axis "
                "may be -1 (it takes the remaining devices). Set the others to explicit sizes.")

    def resolve(self, num_devices: int, labels: Mapping[str, str] | None = None,
                where: str = "mesh") -> ParallelDims:
        """Checks the degrees against ``num_devices`` and fills a -1.

        Raises ``ConfigError`` naming the field (``labels``, as for ``check``) and a fix.
        """
        self.check(labels, where)
        field = _fields(labels)
        fill = [a for a, s in zip(AXES, self.sizes) if s == -1]
        known = math.prod(s for s in self.sizes if s != -1)
        # Callers with names of their own (Accelerate's) name only the axes they set.
        short = labels or {a: a for a in AXES}
        desc = ", ".join(f"{short[a]}={s}" for a, s in zip(AXES, self.sizes) if a in short)
        if fill:
            if num_devices % known:
                raise ConfigError(
                    f"{where}: {desc}: the fixed sizes multiply to {known}, which does not "
                    f"divide the {num_devices} devices, so {field[fill[0]]}=-1 cannot be "
                    f"filled. Choose sizes whose product divides {num_devices}.")
            return dataclasses.replace(self, **{fill[0]: num_devices // known})
        if known != num_devices:
            raise ConfigError(
                f"{where}: {desc} multiply to {known}, but there are {num_devices} devices. "
                "Make the product equal the device count, or set one axis to -1 to take "
                "the remaining devices.")
        return self

    def __str__(self) -> str:
        # expert and stage only where they split (a dense model never splits experts).
        return " x ".join(f"{a}={s}" for a, s in zip(AXES, self.sizes)
                          if a not in ("expert", "stage") or s != 1)


def stages(mesh: Mesh) -> int:
    """The mesh's pipeline stages (``mesh.stage``; 1 for a mesh without the axis). Over more
    than one, the layers run vmapped over ``stage`` (``ndjax.parallel.pipeline``), and the
    shard_maps inside them name the axis as that vmap needs."""
    return mesh.shape.get("stage", 1)


def _fields(labels: Mapping[str, str] | None) -> Mapping[str, str]:
    return {**{a: f"mesh.{a}" for a in AXES}, **(labels or {})}


def _split_across_processes(sizes: tuple[int, ...], num_granules: int) -> tuple[int, ...]:
    """Splits the mesh into (per-node sizes, across-node sizes).

    Outer axes take the across-node factor first (stage, replica, fsdp, ...), so
    tensor and context stay inside a node unless a layout cannot avoid it.
    """
    remaining = num_granules
    across = []
    for size in sizes:
        factor = math.gcd(size, remaining)
        across.append(factor)
        remaining //= factor
    if remaining != 1:
        raise ConfigError(
            f"mesh: cannot lay sizes {dict(zip(AXES, sizes))} over {num_granules} processes; "
            "make replica*fsdp a multiple of the number of processes.")
    return tuple(across)


def build_mesh(dims: ParallelDims, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh (``AXES``) with Auto axis types (GSPMD-style propagation)."""
    devices = list(jax.devices() if devices is None else devices)
    dims = dims.resolve(len(devices))
    axis_types = (AxisType.Auto,) * len(AXES)
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        across = _split_across_processes(dims.sizes, len(processes))
        per_node = tuple(s // a for s, a in zip(dims.sizes, across))
        device_array = mesh_utils.create_hybrid_device_mesh(
            per_node, across, devices, process_is_granule=True)
        return Mesh(device_array, AXES, axis_types=axis_types)
    return jax.make_mesh(dims.sizes, AXES, axis_types=axis_types, devices=devices)


def cross_process_axes(mesh: Mesh, group_of: Callable[[jax.Device], Any] | None = None
                       ) -> list[str]:
    """Mesh axes along which devices of different processes meet, or of different
    groups if ``group_of`` maps each device to one (its host, say)."""
    group_of = group_of or (lambda d: d.process_index)
    labels = np.vectorize(group_of, otypes=[object])(mesh.devices)
    crossing = []
    for i, name in enumerate(mesh.axis_names):
        first = np.take(labels, [0], axis=i)
        if labels.shape[i] > 1 and not np.all(labels == first):
            crossing.append(name)
    return crossing
