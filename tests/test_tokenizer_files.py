"""The special tokens of a tokenizer directory saved by transformers: ndjax reads them from
``tokenizer_config.json`` (and the legacy ``special_tokens_map.json``) as transformers'
AutoTokenizer does, before falling back on the usual names.

Directories are built here with the ``tokenizers`` library and saved with transformers'
``PreTrainedTokenizerFast.save_pretrained``, so the files are what transformers writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from data_files import WORDS, data_config, texts, write_text
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ndjax.data.loader import make_loader
from ndjax.data.tokenizers import ByteTokenizer, load_tokenizer
from ndjax.experiment import Experiment
from ndjax.runtime.errors import ConfigError

# Qwen2's: the vocabulary holds <|endoftext|> (one of ndjax's usual EOS names), but
# tokenizer_config.json says the end token is <|im_end|>; no BOS.
QWEN = dict(special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            eos_token="<|im_end|>", pad_token="<|endoftext|>")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_hf_tokenizer(folder: Path, special: tuple[str, ...] = QWEN["special"],
                       chat_template: str | None = CHATML, add_bos: bool = False,
                       **tokens: str) -> Path:
    """A WordLevel tokenizer (every word of data_files' texts, ``special`` added) saved by
    transformers with ``tokens`` (eos_token=..., bos_token=..., pad_token=...); returns
    the tokenizer.json path. ``add_bos``: its post-processor puts ``bos_token`` before
    every text, as Llama's, Mistral's and Gemma's tokenizer.json do."""
    words = sorted({*WORDS, "doc", ":", *(str(i) for i in range(100)), "[UNK]"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special))
    if add_bos:
        bos = tokens["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **tokens)
    fast.save_pretrained(str(folder))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory) -> Path:
    return write_hf_tokenizer(tmp_path_factory.mktemp("qwen_like"), **{
        k: v for k, v in QWEN.items() if k != "special"})


def test_eos_and_pad_come_from_tokenizer_config(qwen_like):
    """<|im_end|>, as transformers reads it, not the <|endoftext|> the vocabulary also has."""
    tok = load_tokenizer(str(qwen_like))
    ref = AutoTokenizer.from_pretrained(qwen_like.parent)
    assert ref.eos_token == "<|im_end|>" and ref.bos_token_id is None
    assert tok.decode([tok.eos_id]) == "<|im_end|>"
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (ref.eos_token_id, ref.pad_token_id, None)


def test_tokenizer_config_without_a_usual_name(tmp_path):
    """The failure this fixes: no <|endoftext|>, </s>, ... at all, only the end token
    that tokenizer_config.json names (an AddedToken dict, as transformers 4 writes it)."""
    path = write_hf_tokenizer(tmp_path, special=("<|im_start|>", "<|im_end|>"),
                              eos_token="<|im_end|>")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "__type": "AddedToken"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(path))
    assert tok.eos_id == AutoTokenizer.from_pretrained(tmp_path).eos_token_id
    assert tok.pad_id == tok.eos_id  # no pad token anywhere: padding is masked, any id works


def test_bos_from_tokenizer_config_and_legacy_special_tokens_map(tmp_path):
    """bos_token too; special_tokens_map.json (transformers' legacy file, read when
    tokenizer_config.json has no added_tokens_decoder) overrides tokenizer_config.json."""
    path = write_hf_tokenizer(tmp_path, special=("<s>", "</s>", "<|eot|>"), bos_token="<s>",
                              eos_token="</s>", chat_template=None)
    tok = load_tokenizer(str(path))
    assert (tok.eos_id, tok.bos_id) == (tok._tok.token_to_id("</s>"),
                                        tok._tok.token_to_id("<s>"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    ref = AutoTokenizer.from_pretrained(tmp_path)
    load_tokenizer.cache_clear()
    assert load_tokenizer(str(path)).eos_id == ref.eos_token_id == tok._tok.token_to_id("<|eot|>")


def test_data_eos_token_still_overrides(qwen_like):
    tok = load_tokenizer(str(qwen_like), "<|endoftext|>")
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")


def test_eos_token_not_in_the_tokenizer_is_a_config_error(tmp_path):
    path = write_hf_tokenizer(tmp_path, eos_token="<|im_end|>")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|eot_id|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"eos_token='<\|eot_id\|>' of the tokenizer_config"
                                          r"\.json .* is not a token of this tokenizer; fix that "
                                          r"file or set data.eos_token"):
        load_tokenizer(str(path))


def test_byte_tokenizer_ids():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (257, 256, 258)


@pytest.mark.parametrize("eos_token", ["", "<|endoftext|>"])
def test_loader_ends_documents_with_tokenizer_config_eos(qwen_like, tmp_path, eos_token):
    """Fine-tuning on text with data.tokenizer=DIR/tokenizer.json: the checks pass and every
    document of a row ends in <|im_end|> (or data.eos_token, which still wins)."""
    docs = texts(16)
    write_text(tmp_path / "txt", docs)
    config = data_config("text", str(tmp_path / "txt" / "*.txt"), tokenizer=str(qwen_like),
                         eos_token=eos_token, vocab_size=256)
    Experiment.from_config(config, jax.devices()[:1])  # loader.check_config among the checks
    tok = load_tokenizer(str(qwen_like), eos_token)
    want = tok._tok.token_to_id(eos_token or "<|im_end|>")
    ends = set()
    with make_loader(config, 256, prefetch=0) as loader:
        for _ in range(3):
            batch = next(loader)
            seg = batch["segment_ids"]
            # A document's last input (before the next document's segment) is its end token.
            ends |= set(batch["inputs"][:, :-1][seg[:, :-1] != seg[:, 1:]].tolist())
    assert ends == {want}
