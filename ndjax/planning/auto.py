"""``mesh.auto=True``: train.py runs on the planner's best layout for the devices present.

The planner (``ndjax.planning.planner``, what ``ndjax plan`` prints) checks, compiles and
prices every layout of the run's devices and this config, as ``ndjax plan --top=1``
would, and the run takes the first: its mesh degrees, rule table, remat, gradient
accumulation and CP algorithm. The config's remat and grad_accum are where the planner
starts (it only adds to them, as it does for a layout over the memory budget). Pipeline
stages are not planned (``ndjax plan --stages`` is off by default: they multiply the
layouts to compile).

The choice is kept in the plan cache (``planner.default_cache_dir()``), keyed by the
config, the devices and ndjax's source, so a second run of the same config on the
same devices starts at once. In a multi-process run process 0 plans and the others
read its choice from the coordinator's key-value store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections

from ndjax.hardware import roofline
from ndjax.parallel import distributed
from ndjax.parallel.mesh import AXES
from ndjax.planning import planner
from ndjax.runtime.errors import ConfigError

# Where the devices are CPUs (tests, a simulation of a GPU run): the layouts are priced
# as on these GPUs, the roofline's most common target.
CPU_PRICED_AS = "h100"
_KEY = "ndjax/mesh_auto"
_WAIT_S = 3 * 3600  # the other processes wait this long for process 0's plan


@dataclasses.dataclass(frozen=True)
class Choice:
    """The layout chosen, and what the start-up line says about it."""

    layout: planner.Layout
    note: str

    def apply(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """``config`` (not changed) with this layout (``planner.layout_settings``)."""
        return ml_collections.ConfigDict(planner.layout_settings(config, self.layout).to_dict())


def hardware_of(devices: Sequence[jax.Device]) -> tuple[str, str]:
    """The roofline entry the layouts are priced on, and how the note names it."""
    kind = devices[0].device_kind
    if devices[0].platform != "gpu":
        name = roofline.HARDWARE[CPU_PRICED_AS].name
        return CPU_PRICED_AS, f"{len(devices)} {kind} devices priced as {name}"
    for key in roofline.HARDWARE:
        if re.search(rf"\b{key}\b", kind, re.IGNORECASE):
            return key, f"{len(devices)} x {roofline.HARDWARE[key].name}"
    raise ConfigError(
        f"mesh.auto=True: no roofline for {kind!r} (ndjax.hardware.roofline has "
        f"{', '.join(sorted(roofline.HARDWARE))}); set mesh.auto=False and the mesh's "
        "degrees yourself.")


def _cache_key(config: ml_collections.ConfigDict, devices: Sequence[jax.Device],
               hardware: str, per_node: int, fraction: float, cache: planner.Cache) -> str:
    # The degrees and choices the plan replaces are not part of what is planned.
    given = ml_collections.ConfigDict(config.to_dict())
    for axis in AXES:
        given.mesh[axis] = 1
    text = json.dumps({"config": given.to_dict(), "fraction": fraction}, sort_keys=True,
                      default=str)
    return "auto-" + cache.key(text, len(devices),
                               f"{devices[0].device_kind}:{hardware}/{per_node}")


def plan(config: ml_collections.ConfigDict, devices: Sequence[jax.Device],
         progress: Callable[[str], None], cache_dir: str | None = None) -> Choice:
    """The planner's best layout of ``devices`` for ``config`` (from the cache where this
    config was planned on these devices before). ConfigError where none fits."""
    from ndjax.hardware import gpu_target

    n = len(devices)
    hardware, on = hardware_of(devices)
    per_node = max(1, n // len({distributed.host_of(d) for d in devices}))
    fraction = planner.mem_fraction_default()
    cache = planner.Cache(planner.default_cache_dir() if cache_dir is None else cache_dir)
    key = _cache_key(config, devices, hardware, per_node, fraction, cache)
    if (hit := cache.get(key)) is not None:
        return Choice(planner.Layout(**hit["layout"]), hit["note"] + "; from the plan cache")
    on_gpu = devices[0].platform == "gpu"
    # Every layout is checked on the run's own devices. CPU devices compile here too; for
    # GPUs, worker processes compile for their kind (XLA's GPU compiler, compile-only
    # devices: nothing touches the run's GPUs).
    target = hardware if on_gpu and not gpu_target.missing() else None
    workers = min(os.cpu_count() or 1, 4) if on_gpu else 0
    started = time.perf_counter()
    compiler = planner.Compiler(n, workers, cache, progress, target, per_node)
    try:
        result = planner.make_plan(config, n, roofline.HARDWARE[hardware], per_node, fraction,
                                   compiler, devices, None, progress, top=1)
    finally:
        compiler.close()
    ranked = result.by_status("ranked")
    checked = len(result.candidates) + result.aliases
    if not ranked:
        closest = min(result.by_status("over"), key=lambda c: c.memory, default=None)
        closest = closest or next(iter(result.candidates), None)
        why = (f" The closest, {closest.layout.mesh} [{closest.layout.settings}] "
               f"({closest.status}): {' '.join(closest.reason.split())}" if closest else "")
        raise ConfigError(
            f"mesh.auto=True: none of the {checked} layouts of "
            f"{on} fits {result.budget / 2**30:.1f} GiB a device.{why} (`ndjax plan` lists "
            "them all.)")
    best = ranked[0]
    x = best.layout
    note = (f"mesh.auto: {x.mesh} [{x.settings}], remat {x.remat}, grad_accum {x.grad_accum}: "
            f"ndjax plan's best of {checked} layouts for {on}, "
            f"{best.estimate.serial_s * 1e3:.3g} ms a step by its roofline; planned in "
            f"{time.perf_counter() - started:.0f} s")
    cache.put(key, {"layout": dataclasses.asdict(x), "note": note})
    return Choice(x, note)


def resolve(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None,
            cache_dir: str | None = None) -> tuple[ml_collections.ConfigDict, str]:
    """``config`` (with mesh.auto=True) with the planned layout, and the start-up line's
    note. Every process of a run gets process 0's choice."""
    devices = list(jax.devices() if devices is None else devices)
    if jax.process_count() == 1:
        choice = plan(config, devices, _progress, cache_dir)
        return choice.apply(config), choice.note
    kv = distributed.client()
    if jax.process_index() == 0:
        try:
            choice = plan(config, devices, _progress, cache_dir)
        except ConfigError as e:
            kv.key_value_set(_KEY, json.dumps({"error": str(e)}))
            raise
        kv.key_value_set(_KEY, json.dumps({"layout": dataclasses.asdict(choice.layout),
                                           "note": choice.note}))
        return choice.apply(config), choice.note
    got = json.loads(kv.blocking_key_value_get(_KEY, _WAIT_S * 1000))
    if "error" in got:
        raise ConfigError(got["error"])
    choice = Choice(planner.Layout(**got["layout"]), got["note"])
    return choice.apply(config), choice.note


def _progress(message: str) -> None:
    print(f"train.py: mesh.auto: {message}", file=sys.stderr, flush=True)
