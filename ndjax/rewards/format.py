"""An example format reward: ``grpo.reward_funcs=ndjax.rewards.format.think_answer``.

It is an example: copy it to write your own (see ``ndjax.rewards`` for the signature).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ndjax.rewards import text_of

THINK_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def think_answer(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where a completion is its reasoning in ``<think>...</think>`` then its answer
    in ``<answer>...</answer>`` and nothing else (``^<think>.*?</think>\\s*<answer>.*?
    </answer>$``, across lines; a final newline allowed), else 0.0."""
    return [1.0 if THINK_ANSWER.match(text_of(c)) else 0.0 for c in completions]
