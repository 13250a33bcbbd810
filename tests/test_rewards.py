"""Reward functions (ndjax.rewards): how grpo.reward_funcs names them, how they are called
(TRL 1.16's keywords, None as NaN), and the two examples."""

import asyncio
import importlib.util
import re
import sys

import numpy as np
import pytest

from ndjax import rewards
from ndjax.rewards import format as format_rewards
from ndjax.rewards import math as math_rewards
from ndjax.runtime.errors import ConfigError


def write_module(folder, name, text):
    (folder / f"{name}.py").write_text(text)
    sys.modules.pop(name, None)


def test_load_names_functions(tmp_path, monkeypatch):
    fns = rewards.load("ndjax.rewards.math.accuracy, ndjax.rewards.format:think_answer,")
    assert fns == [math_rewards.accuracy, format_rewards.think_answer]
    # a module of the working directory, which the ndjax command's sys.path lacks
    write_module(tmp_path, "my_rewards_cwd", "def short(completions, **kw):\n"
                                             "    return [-len(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (fn,) = rewards.load("my_rewards_cwd.short")
    assert fn(completions=["ab", "c"]) == [-2, -1]


@pytest.mark.parametrize("spec, message", [
    ("", r"grpo.reward_funcs='' names no function"),
    ("accuracy", r"'accuracy' is not a package.module.function name"),
    ("no_such_rewards_mod.fn", r"'no_such_rewards_mod.fn': no module named "
                               r"'no_such_rewards_mod'; the module must be importable from "
                               r"the working directory \(.*\) or PYTHONPATH"),
    ("ndjax.no_such.fn", r"no module named 'ndjax.no_such'"),
    ("ndjax.rewards.math.nope", r"module 'ndjax.rewards.math' has no attribute 'nope' \(its "
                                r"functions: accuracy, final_answer, last_boxed, number\)"),
    ("ndjax.rewards:FIELD", r"'ndjax.rewards:FIELD' is a str, not a function"),
    ("bad_dep_rewards.fn", r"importing 'bad_dep_rewards' failed: it imports "
                           r"'not_installed_dep_xyz', which is not installed"),
    ("raising_rewards.fn", r"importing 'raising_rewards' failed \(ZeroDivisionError: "
                           r"division by zero\)"),
])
def test_load_errors_are_one_line(tmp_path, monkeypatch, spec, message):
    write_module(tmp_path, "bad_dep_rewards", "import not_installed_dep_xyz\n")
    write_module(tmp_path, "raising_rewards", "x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=message) as e:
        rewards.load(f"ndjax.rewards.math.accuracy,{spec}" if spec else spec)
    assert "\n" not in str(e.value) and str(e.value).startswith("grpo.reward_funcs=")


def trl_reward_keywords():
    """The keywords TRL 1.16's _calculate_rewards adds to the columns, read from its source
    (not imported: that takes seconds)."""
    spec = importlib.util.find_spec("trl")  # the test extra's: pip install -e '.[test]'
    assert spec is not None and spec.origin is not None, "trl is not installed"
    source = (spec.origin.rsplit("/", 1)[0] + "/trainer/grpo_trainer.py")
    text = open(source, encoding="utf-8").read()
    body = text[text.index("def _calculate_rewards"):]
    body = body[:body.index("\n    def ")]
    assert "reward_func(\n                        prompts=prompts, completions=completions, " \
           "completion_ids=completion_ids_list, **reward_kwargs" in body
    return set(re.findall(r'(?<!\w)reward_kwargs\["(\w+)"\] =', body))


def test_call_passes_trls_keywords():
    seen = {}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    **kwargs)
        return [float(len(c)) for c in completions]

    records = [{"prompt": "1+1?", "answer": "2", "id": 0}] * 2 + [{"prompt": "2+2?", "id": 1}]
    out = rewards.call([spy], ["1+1?", "1+1?", "2+2?"], ["2", "11", "4"], [[5], [5, 5], [6]],
                       records)
    assert out.dtype == np.float32 and out.tolist() == [[1.0], [2.0], [1.0]]
    extra = trl_reward_keywords() - {"environments"}  # environments: TRL's tool envs only
    assert set(seen) == {"prompts", "completions", "completion_ids", "answer", "id"} | extra
    assert seen["answer"] == ["2", "2", None] and seen["id"] == [0, 0, 1]
    assert seen["trainer_state"] is None and seen["log_metric"]("x", 1.0) is None
    state = object()
    rewards.call([spy], ["q"], ["a"], [[1]], [{"question": "q"}], prompt_field="question",
                 trainer_state=state)
    assert seen["trainer_state"] is state and "question" not in seen


def test_none_is_nan_and_wrong_returns_are_errors():
    def some(completions, **kw):
        return [None if c == "skip" else 1 for c in completions]

    def none(completions, **kw):
        return [None] * len(completions)

    args = (["p"] * 3, ["a", "skip", "b"], [[1]] * 3, [{}] * 3)
    out = rewards.call([some, lambda completions, **kw: np.array([0.5, 0.0, True])], *args)
    assert np.isnan(out[1, 0]) and out[[0, 2], 0].tolist() == [1.0, 1.0]
    assert out[:, 1].tolist() == [0.5, 0.0, 1.0]
    with pytest.warns(UserWarning, match="every reward function returned None for a "
                                         "completion"):
        assert np.isnan(rewards.call([some, none], *args)[1]).all()

    def short(completions, **kw):
        return [1.0]

    def text(completions, **kw):
        return ["1.0"] * len(completions)

    def fixed(completions):  # no **kwargs: TRL's keywords do not fit
        return [1.0] * len(completions)

    for fn, message in ((short, r"test_rewards.*short returned 1 rewards for 3 completions"),
                        (text, r"test_rewards.*text returned '1.0' \(str\) for completion 0"),
                        (lambda **kw: None, r"returned a NoneType, not a list"),
                        (fixed, r"fixed does not take the keywords .*give it \*\*kwargs")):
        with pytest.raises(RuntimeError, match=message) as e:
            rewards.call([fn], *args)
        assert "\n" not in str(e.value) and str(e.value).startswith("grpo.reward_funcs: ")


def test_async_functions_are_awaited():
    async def later(completions, **kw):
        await asyncio.sleep(0)
        return [2.0] * len(completions)

    out = rewards.call([later, format_rewards.think_answer], ["p"], ["x"], [[1]], [{}])
    assert out.tolist() == [[2.0, 0.0]]


def test_math_accuracy():
    completions = ["so 3 + 4 = 7 and the answer is 72", "\\boxed{\\frac{1}{2}} was 7",
                   "it is 0.50.", "1,000 apples", "no number", "\\boxed{x^2 + 1}", "8",
                   [{"role": "assistant", "content": "I get \\boxed{72}"}], "anything"]
    answers = ["#### 72", "0.5", "1/2", 1000, "3", "x^2+1", "9", 72, None]
    assert math_rewards.accuracy(completions, answer=answers) == [
        1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, None]
    assert math_rewards.accuracy(["\\boxed{5}"], solution=["so $x = \\boxed{5}$."]) == [1.0]
    assert math_rewards.accuracy(["5"]) == [None]  # no answer column
    assert math_rewards.accuracy(["5", "5"], answer=[None, "4"], solution=["5", "5"]) == [
        1.0, 0.0]
    assert math_rewards.last_boxed("\\boxed{a} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


def test_format_think_answer():
    good = "<think>\nadd them\n</think>\n<answer>7</answer>"
    cases = [good, good + "\n", "<think>x</think><answer>7</answer>",
             "<answer>7</answer>", "text <think>x</think><answer>7</answer>",
             good + " extra", [{"role": "assistant", "content": good}]]
    assert format_rewards.think_answer(cases) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
