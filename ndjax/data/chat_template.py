"""A tokenizer's chat template: found beside its tokenizer.json, rendered as transformers does.

Where the template comes from, first found wins (transformers' order, plus an override):
``data.chat_template`` (a template ndjax ships, by name, or a Jinja file),
``chat_template.jinja`` beside ``data.tokenizer``, the ``chat_template`` of the
``tokenizer_config.json`` there (a string, or a list of named templates of which
``default`` is used).

The named templates (``chat_templates/<name>.jinja``: ``chatml``, ``llama3``, ``qwen3``,
``gemma3``, Axolotl's names for them) render as the models' own templates do (checked
against them in tests/test_chat_templates.py).

Rendering matches ``transformers``' ``apply_chat_template``: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, ``raise_exception``, ``strftime_now``, ``tojson`` (no HTML escaping),
``dict`` and ``namespace`` that refuse dunder access, the tokenizer's named
special tokens (``bos_token``, ``eos_token``, ...) as variables, and
``{% generation %}`` blocks whose rendered spans are recorded (transformers'
``return_assistant_tokens_mask`` convention).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from ndjax.runtime.errors import ConfigError

# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ConfigError("data.source='chat' renders chat templates with jinja2: "
                          "pip install 'jinja2>=3.1.6'.") from None
    return jinja2


@functools.lru_cache(maxsize=8)
def _environment():
    """The Jinja environment chat templates expect (see the module docstring)."""
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and, while a
        tracker is active, records the body's character span in the output."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.tracking = contextvars.ContextVar("ndjax_generation", default=None)
            environment.extend(track_generation=self.track)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body
                                          ).set_lineno(lineno)

        def _support(self, caller) -> str:
            out = caller()
            if (tracking := self.tracking.get()) is not None:
                blocks, spans = tracking
                start = sum(len(b) for b in blocks)  # the text yielded so far
                spans.append((start, start + len(out)))
            return out

        @contextlib.contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            token = self.tracking.set((blocks, spans))
            try:
                yield
            finally:
                self.tracking.reset(token)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        # dict() without handing the template the dict type itself.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        # Underscore attributes on a namespace would reach Python internals.
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes ({name!r}) on a namespace")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=Namespace)
    return env


class TemplateRefused(Exception):
    """The template raised (``raise_exception``, or an error while rendering) for this
    conversation; the caller names the record."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    text: str
    origin: str                # where it was read, for errors
    variables: dict[str, str]  # the named special tokens of tokenizer_config.json

    @property
    def has_generation_blocks(self) -> bool:
        return bool(_GENERATION.search(self.text))

    @functools.cached_property
    def _compiled(self):
        jinja2 = _jinja()
        try:
            return _environment().from_string(self.text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError(f"{self.origin}: line {e.lineno}: the chat template is not valid "
                              f"Jinja ({e.message}); fix it or set data.chat_template to a "
                              "template file.") from None

    def check(self) -> None:
        """Compiles the template (a syntax error is a ConfigError naming its origin)."""
        self._compiled  # noqa: B018

    def _context(self, messages: list[dict], add_generation_prompt: bool) -> dict[str, Any]:
        return {**self.variables, "messages": messages, "tools": None, "documents": None,
                "add_generation_prompt": add_generation_prompt}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self._compiled.render(self._context(messages, add_generation_prompt))
        except Exception as e:  # TemplateError from raise_exception, or any error in it
            raise TemplateRefused(" ".join(str(e).split()) or type(e).__name__) from None

    def render_tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation and the character spans of its ``{% generation %}`` blocks."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with self._compiled.environment.track_generation(blocks, spans):
                for block in self._compiled.generate(self._context(messages, False)):
                    blocks.append(block)
        except Exception as e:
            raise TemplateRefused(" ".join(str(e).split()) or type(e).__name__) from None
        return "".join(blocks), spans


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(tokenizer: str, template_file: str = "",
                       needed_by: str = "data.source='chat'",
                       fix: str = "set data.chat_template to a Jinja template file"
                       ) -> ChatTemplate:
    """The chat template for ``data.tokenizer`` (a tokenizer.json path), or
    ``data.chat_template`` (a template name or a file, ``template_path``); a ConfigError
    when there is none, saying who needs it and the fix."""
    folder = os.path.dirname(os.path.abspath(tokenizer))
    config_path = os.path.join(folder, "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"data.tokenizer={tokenizer!r}: {config_path} is not valid JSON "
                              f"({e}); fix it or remove it.") from None
    variables = {name: text for name in SPECIAL_TOKEN_NAMES
                 if (text := token_text(config.get(name))) is not None}
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if template_file:
        path = template_path(template_file)
        text, origin = _read(path), f"data.chat_template={template_file!r}"
    elif os.path.isfile(jinja_path):
        text, origin = _read(jinja_path), jinja_path
    else:
        text, origin = _config_template(config.get("chat_template")), config_path
    if not text:
        raise ConfigError(
            f"data.tokenizer={tokenizer!r} has no chat template (no chat_template.jinja or "
            f"chat_template in tokenizer_config.json beside it), which {needed_by} needs; "
            f"{fix}.")
    template = ChatTemplate(text, origin, variables)
    template.check()
    return template


TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


def template_names() -> tuple[str, ...]:
    """The chat templates ndjax ships, by name (``chat_templates/<name>.jinja``)."""
    return tuple(sorted(f[:-len(".jinja")] for f in os.listdir(TEMPLATES_DIR)
                        if f.endswith(".jinja")))


def is_template_name(value: str) -> bool:
    """Whether ``data.chat_template`` names a template rather than a file: no path
    separator and no ``.jinja`` ending."""
    return bool(value) and "/" not in value and os.sep not in value \
        and not value.endswith(".jinja")


def template_path(value: str, field: str = "data.chat_template") -> str:
    """The Jinja file ``data.chat_template`` means: a shipped template by name, else the
    file itself; a ConfigError naming the field when there is neither."""
    names = template_names()
    if value in names:
        return os.path.join(TEMPLATES_DIR, value + ".jinja")
    if os.path.isfile(value):
        return value
    if is_template_name(value):
        raise ConfigError(f"{field}={value!r}: no chat template of that name; use one of "
                          f"{', '.join(names)}, the path of a Jinja file, or '' for the "
                          "tokenizer's own.")
    raise ConfigError(f"{field}={value!r}: no such file; give the path of a Jinja chat "
                      f"template, a template name ({', '.join(names)}), or '' for the "
                      "tokenizer's own.")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _config_template(value: Any) -> str:
    """tokenizer_config.json's chat_template: a string, or [{name, template}, ...] of which
    transformers uses 'default'."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else ""
