"""Which platform a step is built for: that of its devices, not jax's default backend.

The two differ when compiling for GPUs from a CPU process (``ndjax.hardware.gpu_target``):
the dtypes ``auto`` picks, the attention kernel, the layer loop and the compiler
options must be the GPU's. Code below ``Experiment`` asks ``current()``, which
reads the devices of the active rule table's mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax

from ndjax.parallel.rules import active


def _first(devices: Iterable[jax.Device]) -> jax.Device:
    # A mesh's ``devices.flat`` is an iterator of its own: never advance the caller's.
    return devices[0] if isinstance(devices, Sequence) else list(devices)[0]


def of(devices: Iterable[jax.Device]) -> str:
    """``cpu``, ``gpu`` or ``tpu``: the platform of the first device."""
    return _first(devices).platform


def compute_capability(devices: Iterable[jax.Device]) -> str | None:
    """Of the first device, e.g. ``"9.0"``; None off NVIDIA GPUs."""
    first = _first(devices)
    return getattr(first, "compute_capability", None) if first.platform == "gpu" else None


def current() -> str:
    """The platform of the active mesh's devices, else jax's default backend."""
    rules = active()
    if rules is not None and rules.mesh is not None:
        return of(rules.mesh.devices.flat)
    return jax.default_backend()
