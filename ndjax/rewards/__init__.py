"""Reward functions for GRPO (``train.objective=grpo``): how ``grpo.reward_funcs`` names
them (``load``), and how they are called (``call``), as TRL 1.16's ``GRPOTrainer`` calls
its reward functions (``_calculate_rewards``).

``grpo.reward_funcs`` is a comma-separated list of Python functions, each named
``package.module.function`` (TRL's and Axolotl's form) or ``package.module:function``;
the module must be importable from the working directory or ``PYTHONPATH``.

Writing one: a function that takes keywords and returns one reward per completion::

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]:
        ...

- ``prompts``: each completion's prompt as the record holds it (a string, or a list
  of ``{role, content}`` messages), repeated for each completion of a prompt;
- ``completions``: the completions, decoded: strings, or for prompts of messages
  ``[{"role": "assistant", "content": text}]`` (``text_of`` reads either);
- ``completion_ids``: their token ids (lists of ints);
- every other column of the prompt records, by name, one value per completion (e.g.
  ``answer=[...]``);
- ``trainer_state``, ``log_extra`` and ``log_metric``, as TRL passes them (here the
  trainer's or None, and callables that log or ignore what they are given): take
  ``**kwargs`` so that the keywords you do not use are accepted.

Return a list (or array) of ``len(completions)`` numbers, ``None`` where the function
does not apply to a completion (it is then left out of that completion's reward, as in
TRL). ``ndjax.rewards.math.accuracy`` and ``ndjax.rewards.format.think_answer`` are
examples to name or copy.
"""

# No ``import math`` here (nor a use of ``format()``): importing the example modules
# ``ndjax.rewards.math`` / ``.format`` binds those names in this package's namespace.

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ndjax.runtime.errors import ConfigError

FIELD = "grpo.reward_funcs"
# The record columns TRL does not pass (its own keywords, and the prompt's column).
_NOT_COLUMNS = ("prompt", "completion", "completion_ids", "prompts", "completions")


def load(spec: str) -> list[Callable[..., Any]]:
    """The functions ``spec`` names (comma-separated ``package.module.function`` or
    ``package.module:function``), imported. Each failure is one ConfigError naming
    ``grpo.reward_funcs``, the value and the reason."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{FIELD}={spec!r} names no function; set it to one or more "
                          "package.module.function names (comma-separated), e.g. "
                          "ndjax.rewards.math.accuracy.")
    _importable_from_cwd()
    return [_load_one(spec, name) for name in names]


def _importable_from_cwd() -> None:
    """Modules of the working directory import, as with ``python -m``: the ``ndjax``
    command's path lacks it (appended, so that it shadows no installed package)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def _load_one(spec: str, name: str) -> Callable[..., Any]:
    where = f"{FIELD}={spec!r}: {name!r}"
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where} is not a package.module.function name (reward models, "
                          "TRL's other kind of reward, are not supported); name a Python "
                          "function.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(f"{where}: no module named {missing!r}; the module must be "
                              f"importable from the working directory ({os.getcwd()}) or "
                              "PYTHONPATH.") from None
        raise ConfigError(f"{where}: importing {module_name!r} failed: it imports "
                          f"{missing!r}, which is not installed.") from None
    except Exception as e:  # a module that fails as it runs: its error, in one line
        raise ConfigError(f"{where}: importing {module_name!r} failed "
                          f"({type(e).__name__}: {_line(e)}).") from None
    if not hasattr(module, attr):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        has = f" (its functions: {', '.join(defined[:8])})" if defined else ""
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}{has}.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{where} is a {type(fn).__name__}, not a function.")
    return fn


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def name(fn: Callable[..., Any]) -> str:
    """A function's ``module.name``, for messages."""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qual}" if module else qual


def text_of(completion: str | Sequence[dict]) -> str:
    """A completion's text: the string, or the content of its last message (TRL's
    conversational form, ``[{"role": "assistant", "content": text}]``)."""
    if isinstance(completion, str):
        return completion
    if completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else ""
    return ""


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``log_extra`` / ``log_metric`` where the caller keeps no log."""


def call(fns: Sequence[Callable[..., Any]], prompts: Sequence[Any],
         completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
         records: Sequence[dict], *, prompt_field: str = "prompt", **extra: Any
         ) -> np.ndarray:
    """Each function's reward of each completion: ``(n, k)`` float32 for ``n``
    completions and ``k`` functions, NaN where a function returned None.

    As TRL's ``_calculate_rewards``: ``fn(prompts=, completions=, completion_ids=,
    **columns, trainer_state=, log_extra=, log_metric=)``, where ``columns`` are the
    records' fields (the keys of the first record, as TRL's; a record without one gives
    None) but the prompt's (``prompt_field``, and TRL's own keywords), one value per
    completion. ``prompts``, ``completion_ids`` and ``records`` hold one entry per
    completion (a prompt's repeated for each of its completions). ``extra`` adds or
    overrides keywords (``trainer_state`` defaults to None, ``log_extra`` and
    ``log_metric`` to callables that ignore what they are given). Async functions are
    awaited, together.

    A function that returns other than one number (or None) per completion is a
    RuntimeError naming it; a completion that every function gave None is warned about
    (TRL's warning): its reward is missing.
    """
    n = len(completions)
    if not len(prompts) == len(completion_ids) == len(records) == n:
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, "
                         f"{len(completion_ids)} completion_ids and {len(records)} records: "
                         "give one of each per completion")
    skip = set(_NOT_COLUMNS) | {prompt_field}
    keys = [k for k in (records[0] if n else {}) if k not in skip]
    kwargs: dict[str, Any] = {k: [r.get(k) for r in records] for k in keys}
    kwargs.update(trainer_state=None, log_extra=_ignore, log_metric=_ignore)
    kwargs.update(extra)
    out = np.full((n, len(fns)), np.nan, np.float32)
    pending: list[tuple[int, Any]] = []
    for k, fn in enumerate(fns):
        _check_keywords(fn, kwargs)
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    **kwargs)
        if inspect.isawaitable(values):
            pending.append((k, values))
        else:
            out[:, k] = _rewards(fn, values, n)
    if pending:
        async def gather() -> list[Any]:
            return await asyncio.gather(*(v for _, v in pending))

        for (k, _), values in zip(pending, asyncio.run(gather())):
            out[:, k] = _rewards(fns[k], values, n)
    if len(fns) and np.isnan(out).all(axis=1).any():
        warnings.warn(f"{FIELD}: every reward function returned None for a completion, so "
                      "its reward is missing (no advantage); make sure one of them scores "
                      "every completion.", stacklevel=2)
    return out


def _check_keywords(fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """A function that cannot take the keywords is an error naming it (before it runs,
    so that a TypeError inside it is its own)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: just call it
        return
    try:
        signature.bind(prompts=None, completions=None, completion_ids=None, **kwargs)
    except TypeError as e:
        raise RuntimeError(
            f"{FIELD}: reward function {name(fn)} does not take the keywords it is called "
            f"with (prompts, completions, completion_ids, {', '.join(kwargs)}): {e}; give "
            "it **kwargs.") from None


def _rewards(fn: Callable[..., Any], values: Any, n: int) -> np.ndarray:
    """A function's return value checked: ``n`` numbers (None: NaN)."""
    if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values,
                                                                                "__len__"):
        raise RuntimeError(f"{FIELD}: reward function {name(fn)} returned a "
                           f"{type(values).__name__}, not a list of {n} rewards (one per "
                           "completion, None where it does not apply).")
    values = list(values)
    if len(values) != n:
        raise RuntimeError(f"{FIELD}: reward function {name(fn)} returned {len(values)} "
                           f"rewards for {n} completions; return one per completion (None "
                           "where it does not apply).")
    return np.array([np.nan if v is None else _number(fn, v, i)
                     for i, v in enumerate(values)], np.float32).reshape(n)


def _number(fn: Callable[..., Any], v: Any, i: int) -> float:
    """One reward: Python's, numpy's (or torch's) scalars; never text."""
    if not isinstance(v, (str, bytes)):
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    text = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    raise RuntimeError(f"{FIELD}: reward function {name(fn)} returned {text} "
                       f"({type(v).__name__}) for completion {i}, not a number or None.")
