"""Text -> token ids: byte-level (the default, needs nothing) or a Hugging Face tokenizer.json.

Both expose the same small interface (``Tokenizer``): ``vocab_size`` (one past
the largest id it can emit, what the model's embedding must cover), ``eos_id``
(appended after every document when packing), ``pad_id`` (the input id of
padding, which the loss mask and segment id 0 hide), ``bos_id`` (None if there
is none; training adds no BOS, exports write it) and ``encode_batch``.

A tokenizer.json's special tokens are read as transformers' AutoTokenizer reads
them: from the ``tokenizer_config.json`` beside it (and the legacy
``special_tokens_map.json``), so the EOS that ends documents is the one the
checkpoint's own tokenizer and generation stop at (``<|im_end|>`` for Qwen, not
the ``<|endoftext|>`` its vocabulary also holds).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ndjax.data.chat_template import token_text
from ndjax.runtime.errors import ConfigError

if TYPE_CHECKING:
    import tokenizers  # imported when a tokenizer.json is read (a slow import)

# Special tokens of HF tokenizers that end a document, most specific first: the guess
# when neither data.eos_token nor tokenizer_config.json names one.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None
    takes_bytes: bool  # False: documents must be decoded to str first

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (halves memory for vocabs <= 65536)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; the special tokens come after them."""

    name = "byte"
    EOS, BOS, PAD = 256, 257, 258
    vocab_size = 259
    eos_id, pad_id, bos_id = EOS, PAD, BOS
    takes_bytes = True

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # Bytes pass straight through: no decoding, so any file (even one that
        # is not valid UTF-8) tokenizes.
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8)
                .astype(np.uint16) for t in texts]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One text's ids (generation prompts); training adds no BOS, so neither does this."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Additions:
    """Tokens a run adds to a tokenizer.json, as transformers' ``add_tokens`` and
    ``add_special_tokens`` add them (Axolotl's ``tokens`` and ``special_tokens``): each
    one absent from the vocabulary gets the next id, never normalized or stripped."""

    tokens: tuple[str, ...] = ()
    special: tuple[str, ...] = ()

    def check(self) -> None:
        for field, values in (("data.added_tokens", self.tokens),
                              ("data.added_special_tokens", self.special)):
            bad = [t for t in values if not isinstance(t, str) or not t]
            if bad:
                raise ConfigError(f"{field}={values!r}: every token must be a non-empty "
                                  f"string ({bad[0]!r} is not).")

    def add_to(self, tok: tokenizers.Tokenizer) -> None:
        from tokenizers import AddedToken

        self.check()
        if self.special:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in self.special])
        if self.tokens:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t in self.tokens])

    def __bool__(self) -> bool:
        return bool(self.tokens or self.special)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library."""

    takes_bytes = False

    def __init__(self, path: str, eos_token: str = "", field: str = "data.tokenizer", *,
                 bos_token: str = "", pad_token: str = "", added: Additions | None = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # a runtime dependency, but be clear if it is missing
            raise ConfigError(f"{field}={path!r} needs the tokenizers package: "
                              "pip install tokenizers.") from e
        if not os.path.isfile(path):
            raise ConfigError(f"{field}={path!r}: no such file. Give the path of a Hugging Face "
                              "tokenizer.json, or 'byte' for the byte-level tokenizer.")
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ConfigError(f"{field}={path!r} is not a valid tokenizer.json: "
                              f"{str(e).splitlines()[0]}") from None
        self.name = path
        # The ids of the file itself; added tokens (data.added_tokens) come after them.
        self.file_vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.added = added or Additions()
        self.added.add_to(self._tok)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # The named special tokens (eos_token, bos_token, pad_token...) of the files
        # transformers saves beside tokenizer.json, and those the config names.
        self.special = special_tokens(path, field)
        self.chosen = {k: v for k, v in (("eos_token", eos_token), ("bos_token", bos_token),
                                         ("pad_token", pad_token)) if v}
        for key, text in self.chosen.items():
            if key != "eos_token" and self._tok.token_to_id(text) is None:
                raise ConfigError(f"data.{key}={text!r} is not a token of data.tokenizer="
                                  f"{path!r}; name one it has, or add it with "
                                  "data.added_special_tokens.")
        self.special.update({k: v for k, v in self.chosen.items() if k != "eos_token"})
        named_eos = self.special.get("eos_token")
        if eos_token:
            names = (eos_token,)
        elif named_eos is not None:
            # transformers would add a missing eos_token to the vocabulary as a new id the
            # model never saw; that is a broken directory, not a guess to make silently.
            if self._tok.token_to_id(named_eos) is None:
                raise ConfigError(
                    f"{field}={path!r}: eos_token={named_eos!r} of the tokenizer_config.json "
                    "(or special_tokens_map.json) beside it is not a token of this tokenizer; "
                    "fix that file or set data.eos_token to the token that ends a document.")
            names = (named_eos,)
        else:
            names = EOS_CANDIDATES
        found = [t for t in names if self._tok.token_to_id(t) is not None]
        if not found:
            what = (f"data.eos_token={eos_token!r} is not" if eos_token
                    else f"none of {', '.join(EOS_CANDIDATES)} is")
            raise ConfigError(f"{field}={path!r}: {what} a token of this tokenizer; set "
                              "data.eos_token to the token that ends a document.")
        self.eos_id = self._tok.token_to_id(found[0])
        # Training adds no BOS; the id is for exports (config.json's bos_token_id). A
        # bos_token missing from the vocabulary leaves it unknown rather than failing.
        bos = self.special.get("bos_token")
        self.bos_id = None if bos is None else self._tok.token_to_id(bos)
        # Padding is masked out of the loss and attention, so any valid id works; the
        # named pad_token first, so that exports and transformers agree on it.
        pads = (self.special.get("pad_token"), "<pad>", "[PAD]")
        self.pad_id = next((i for i in (self._tok.token_to_id(t) for t in pads if t)
                            if i is not None), self.eos_id)
        self._dtype = token_dtype(self.vocab_size)

    @property
    def tokenizer(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` read from the file, for callers that tokenize by
        other rules than ndjax's documents (Axolotl's prompt formats: special tokens
        added, pieces tokenized apart)."""
        return self._tok

    def to_json(self) -> str:
        """tokenizer.json's text, with the tokens this run added (for exports)."""
        return self._tok.to_str()

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # Callers decode bytes themselves (sources.Document.text names the file
        # and line of bad UTF-8). Documents get no BOS/EOS from the tokenizer's
        # post-processor: packing adds exactly one EOS after each.
        if any(isinstance(t, bytes) for t in texts):
            raise TypeError("HFTokenizer.encode_batch takes str; decode bytes first")
        encoded = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, self._dtype) for e in encoded]

    def encode_offsets(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Ids and each token's ``(start, end)`` character offsets ``(n, 2)`` in its text,
        without special tokens added: what chat data needs to find the assistant's tokens."""
        encoded = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [(np.asarray(e.ids, self._dtype), np.asarray(e.offsets, np.int64).reshape(-1, 2))
                for e in encoded]

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every added token marked special (``<|eot_id|>``, ``<|im_end|>``...)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values()
                     if t.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One text's ids (generation prompts); ``add_special_tokens`` runs the tokenizer's
        post-processor (a BOS, for Llama) as transformers does by default."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The token text of one id (a special token's own text, e.g. ``<|im_end|>``)."""
        return self._tok.id_to_token(int(i))


SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _read_json(path: str, field: str, tokenizer: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{field}={tokenizer!r}: {path} is not valid JSON ({e}); fix it or "
                          "remove it.") from None
    return data if isinstance(data, dict) else {}


def special_tokens(path: str, field: str = "data.tokenizer") -> dict[str, str | None]:
    """``{"eos_token": "<|im_end|>", "bos_token": None, ...}``: the special tokens that the
    files beside tokenizer.json ``path`` name, merged as transformers 5 merges them.

    tokenizer_config.json holds each as a string or an AddedToken dict (``content``);
    special_tokens_map.json, the legacy file, overrides it only when tokenizer_config.json
    has no ``added_tokens_decoder`` (transformers 4 saves both, with the same tokens).
    A key present with null means "none", as in Qwen's ``"bos_token": null``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    config, legacy = (_read_json(p, field, path) if os.path.isfile(p) else {}
                      for p in (os.path.join(folder, n) for n in SPECIAL_FILES))
    merged = dict(config)
    if "added_tokens_decoder" not in config:
        merged.update(legacy)
    return {k: token_text(v) for k, v in merged.items()
            if k.endswith("_token") and (v is None or token_text(v) is not None)}


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str, eos_token: str = "", bos_token: str = "", pad_token: str = "",
                   added: Additions | None = None) -> ByteTokenizer | HFTokenizer:
    """``'byte'`` or the path of a tokenizer.json (cached: the config check and the loader
    both ask for it)."""
    if name == "byte":
        for field, value in (("eos_token", eos_token), ("bos_token", bos_token),
                             ("pad_token", pad_token)):
            if value:
                raise ConfigError(f"data.{field}={value!r} applies to a tokenizer.json; the "
                                  "byte tokenizer's are ids 256-258. Leave it empty.")
        if added:
            raise ConfigError(f"data.added_tokens={added.tokens!r}, data.added_special_tokens="
                              f"{added.special!r} add to a tokenizer.json; the byte tokenizer "
                              "takes none. Set data.tokenizer or leave them empty.")
        return ByteTokenizer()
    return HFTokenizer(name, eos_token, bos_token=bos_token, pad_token=pad_token, added=added)
