"""The machine this process runs on, as benchmarks report it."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """This machine's CPU as /proc/cpuinfo names it (``model name``), else what
    ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"
