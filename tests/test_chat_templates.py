"""ndjax's named chat templates (``data.chat_template=chatml`` ...) render exactly as the
models' own templates do, and name lookups fail clearly.

Checked: string equality of ndjax's rendering (``ChatTemplate.render``) of each shipped
template with transformers' rendering (``render_jinja_template``, what
``apply_chat_template`` calls) of the vendor's template text, stored in
tests/chat_template_refs/ (sources in its README), for conversations with and without a
system message, one and several turns, contents with edge whitespace, newlines and
non-ASCII text, with ``add_generation_prompt`` True and False, and, for Qwen3, reasoning
(``reasoning_content`` or ``<think>`` in the content), tool calls and tool results.

Not checked: what ndjax never passes to a template (``tools``, ``documents``,
``enable_thinking``), and non-string contents (images), which ndjax's records cannot
hold; the shipped templates handle only string contents (see docs/data.md).
"""

import os

import pytest

from ndjax.data.chat_template import (
    TEMPLATES_DIR,
    ChatTemplate,
    load_chat_template,
    template_names,
    template_path,
)
from ndjax.runtime.errors import ConfigError

REFS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_template_refs")
# The named special tokens of each model's tokenizer_config.json the templates read.
TOKENS = {"chatml": {"bos_token": "<s>", "eos_token": "<|im_end|>"},
          "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
          "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
          "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}}

U, A, S, T = "user", "assistant", "system", "tool"


def m(role, content, **extra):
    return {"role": role, "content": content, **extra}


# Conversations every template renders (user and assistant alternate: Gemma requires it).
COMMON = [
    [m(U, "hi?"), m(A, "hello.")],
    [m(S, "be brief"), m(U, "alpha beta?"), m(A, " gamma delta. ")],
    [m(U, "one?"), m(A, "two."), m(U, "  three?\n"), m(A, "four\nfive\n")],
    [m(S, "You are terse.\nVery."), m(U, "café naïve ✓?"), m(A, "déjà vu — ok."),
     m(U, "and?"), m(A, "no."), m(U, "why"), m(A, "because\n\n")],
    [m(U, "")],
    [m(S, "sys only first"), m(U, "q")],
]
CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
QWEN3 = [
    [m(U, "think?"), m(A, "<think>\nsteps here\n</think>\n\nanswer.")],
    [m(U, "a?"), m(A, "b.", reasoning_content="why b"), m(U, "c?"),
     m(A, "<think>x</think>d.")],
    [m(U, "a?"), m(A, "<think>early</think>b."), m(U, "c?"), m(A, "d.")],
    [m(S, "tools follow"), m(U, "weather in zürich?"), m(A, "", tool_calls=[CALL]),
     m(T, "sunny"), m(T, "12 C"), m(A, "sunny, 12 C.", reasoning_content="read it")],
    [m(U, "two calls"), m(A, "calling", tool_calls=[CALL, {"function": {
        "name": "time", "arguments": '{"tz": "UTC"}'}}]), m(T, "ok"), m(A, "done")],
    [m(U, "<tool_response>\nx\n</tool_response>"), m(A, "y")],
]


def reference(name: str) -> str:
    with open(os.path.join(REFS, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def render_reference(name: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """The vendor's template rendered by transformers, as apply_chat_template does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=reference(name),
                                        add_generation_prompt=add_generation_prompt,
                                        **TOKENS[name])
    return rendered[0]


def shipped(name: str) -> ChatTemplate:
    with open(template_path(name), encoding="utf-8") as f:
        return ChatTemplate(f.read(), name, TOKENS[name])


def test_the_shipped_names():
    assert {"chatml", "llama3", "qwen3", "gemma3"} <= set(template_names())
    assert sorted(os.listdir(REFS)) == sorted([f"{n}.jinja" for n in TOKENS] + ["README.md"])


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(TOKENS))
def test_renders_as_the_vendor_template(name, generation_prompt):
    template = shipped(name)
    chats = COMMON + (QWEN3 if name == "qwen3" else [])
    for messages in chats:
        # Every prefix too: the prefix renderings are what the loss mask is found from.
        for k in range(1, len(messages) + 1):
            want = render_reference(name, messages[:k], generation_prompt)
            assert template.render(messages[:k], generation_prompt) == want, (name, messages[:k])


def test_qwen3_marks_each_reply_with_generation_blocks():
    # The tokens learned are the text inside the blocks: everything after the assistant's
    # header, through <|im_end|>; transformers finds the same blocks.
    from transformers.utils.chat_template_utils import render_jinja_template

    template = shipped("qwen3")
    assert template.has_generation_blocks
    for messages in QWEN3 + COMMON[:4]:
        text, spans = template.render_tracked(messages)
        rendered, indices = render_jinja_template(
            [messages], chat_template=template.text, return_assistant_tokens_mask=True,
            **TOKENS["qwen3"])
        assert text == rendered[0]
        assert [tuple(i) for i in indices[0]] == spans
        assert len(spans) == sum(msg["role"] == A for msg in messages)
        assert all(text[s:e].endswith("<|im_end|>") for s, e in spans)
        assert all(text[:s].endswith("<|im_start|>assistant\n") for s, _ in spans)


def test_a_name_loads_with_the_tokenizers_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|begin_of_text|>", "chat_template": "{{ 1 }}"}')
    template = load_chat_template(str(tmp_path / "tokenizer.json"), "llama3")
    assert template.origin == "data.chat_template='llama3'"
    assert template.render([m(U, " hi ")], True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert template_path("gemma3") == os.path.join(TEMPLATES_DIR, "gemma3.jinja")


@pytest.mark.parametrize("value, says", [
    ("chatml2", r"data.chat_template='chatml2': no chat template of that name; use one of "
                r"chatml, gemma3, llama3, qwen3"),
    ("missing.jinja", r"data.chat_template='missing.jinja': no such file; give the path"),
    ("dir/none", r"data.chat_template='dir/none': no such file"),
])
def test_unknown_names_and_files_are_one_line_errors(tmp_path, value, says):
    with pytest.raises(ConfigError, match=says) as e:
        load_chat_template(str(tmp_path / "tokenizer.json"), value)
    assert "\n" not in str(e.value)


def test_a_file_is_still_a_file(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for x in messages %}{{ x['content'] }}|{% endfor %}")
    template = load_chat_template(str(tmp_path / "tokenizer.json"), str(path))
    assert template.render([m(U, "a"), m(A, "b")]) == "a|b|"
