"""jax's persistent compilation cache for train.py runs (``runtime.compilation_cache``).

A run's compiled programs (the train step, the state's init) are written to a
directory and loaded by the next run that compiles the same program with the same
jax, XLA flags and devices: the second run of an unchanged config skips XLA's
compile, which is most of its time to the first step (``bench/first_step.py``).

The default directory is per user, ``$XDG_CACHE_HOME/ndjax/xla`` (else
``~/.cache/ndjax/xla``, beside the planner's ``~/.cache/ndjax/plan``), not per
workdir: the repeats worth caching are new runs of the same model in new workdirs
(an iteration on the data or the lr, the planner's trials, CI), and a workdir's
cache would die with it. jax keys entries by the program, its compile options,
the devices and jax's version, so a stale entry is never loaded; the directory is
not trimmed (``JAX_COMPILATION_CACHE_MAX_SIZE`` caps it, with the ``filelock``
package) and can be deleted at any time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from ndjax.runtime.errors import ConfigError

AUTO, OFF = "auto", "off"
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# jax's default (1 s) would leave out an init compiled with the quick CPU options
# (ndjax.runtime.compiler.init_options, ~1 s); an eager op's tiny program (milliseconds)
# stays out.
MIN_COMPILE_SECS = 0.2


def default_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ndjax", "xla")


def directory(setting: str, env: Mapping[str, str] | None = None) -> str | None:
    """Where ``runtime.compilation_cache`` puts the cache; None: nowhere.

    ``auto``: ``$JAX_COMPILATION_CACHE_DIR`` if set (jax's own variable, which the
    test suite sets for the runs it starts), else ``default_dir()``; ``off``: no
    cache; anything else is the directory."""
    env = os.environ if env is None else env
    setting = setting.strip()
    if setting.lower() == OFF:
        return None
    if setting.lower() == AUTO:
        return env.get(ENV_DIR) or default_dir(env)
    if not setting:
        raise ConfigError("runtime.compilation_cache='' names no directory: use 'auto', 'off' "
                          "or a directory.")
    return os.path.expanduser(setting)


def configure(setting: str, env: Mapping[str, str] | None = None) -> str | None:
    """Sets jax's persistent cache as ``runtime.compilation_cache`` says; returns the
    directory (None: off). Call before anything compiles."""
    env = os.environ if env is None else env
    path = directory(setting, env)
    if path is None:
        # Off means nothing is read or written, whatever the environment says.
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if ENV_MIN_TIME not in env:  # a threshold the user chose stays theirs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    return path
