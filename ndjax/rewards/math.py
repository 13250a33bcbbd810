"""An example verifiable reward for math data: ``grpo.reward_funcs=ndjax.rewards.math.accuracy``.

It is an example, kept simple (no symbolic equivalence, as TRL's ``accuracy_reward``
gets from math_verify): copy it to write your own (see ``ndjax.rewards`` for the
signature).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from ndjax.rewards import text_of

# A number as written in text: an optional sign, digits with optional thousands commas,
# an optional decimal part (or a leading-dot decimal), an optional /denominator.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def accuracy(completions: Sequence[Any], answer: Sequence[Any] | None = None,
             solution: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 where a completion's final answer equals its record's ``answer`` (or, where
    that is missing, its ``solution``), 0.0 where not, None where the record has neither.

    A completion's final answer is the content of its last ``\\boxed{...}``, else the
    last number in it. A reference that is not itself a number is the content of its
    last ``\\boxed{...}`` (MATH's solutions), else what follows its last ``####``
    (GSM8K's answers), else the whole text. The two are compared as exact numbers where
    both parse as one (an int, a decimal, a fraction ``a/b`` or ``\\frac{a}{b}``;
    thousands commas, ``$`` and ``%`` ignored), so ``0.5`` equals ``1/2`` and ``1,000``
    equals ``1000.0``; otherwise as text with the spaces removed.
    """
    out: list[float | None] = []
    for i, completion in enumerate(completions):
        reference = next((column[i] for column in (answer, solution)
                          if column is not None and column[i] is not None), None)
        if reference is None:
            out.append(None)
            continue
        got = final_answer(text_of(completion))
        out.append(1.0 if got is not None and _equal(got, _reference(reference)) else 0.0)
    return out


def final_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text``, else its last number, else
    None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    at, depth = start + len("\\boxed{"), 1
    for end in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[at:end]
    return None  # unclosed


def number(text: str) -> Fraction | None:
    """``text`` as an exact number (see ``accuracy``), or None."""
    text = _FRAC.sub(r"(\1)/(\2)", text)
    text = re.sub(r"\\[$%,!;]|\s+|\$|%", "", text)
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text).rstrip(".")
    fraction = re.fullmatch(r"\(?([-+]?[\d.]+)\)?/\(?([-+]?[\d.]+)\)?", text)
    try:
        if fraction:
            return Fraction(fraction.group(1)) / Fraction(fraction.group(2))
        return Fraction(text.strip("()"))
    except (ValueError, ZeroDivisionError):
        return None


def _reference(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    text = str(value)
    if number(text) is not None:
        return text
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    return text.rsplit("####", 1)[1].strip() if "####" in text else text


def _equal(got: str, want: str) -> bool:
    a, b = number(got), number(want)
    if a is not None and b is not None:
        return a == b
    return re.sub(r"\s+", "", got) == re.sub(r"\s+", "", want)
