"""Every source and tokenizer loads a small file the test writes; shares tile the corpus;
bad input is one clear ConfigError naming the file (and line)."""

import os

import jax
import numpy as np
import pytest
from data_files import data_config, texts, write_jsonl, write_parquet, write_text, write_tokenizer

from ndjax.data import BATCH_FIELDS, sources
from ndjax.data.loader import make_loader
from ndjax.data.packing import unpack
from ndjax.data.prepare import main as prepare_main
from ndjax.data.prepare import prepare
from ndjax.data.tokenizers import load_tokenizer
from ndjax.experiment import Experiment
from ndjax.runtime.errors import ConfigError

DOCS = texts()
CORPUS = "\n".join(DOCS) + "\n"


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory):
    return str(write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", DOCS))


def write_corpus(kind, root):
    """Writes DOCS as ``kind`` files under ``root``; returns the data.files value."""
    if kind == "text":
        write_text(root / "txt", DOCS)
        return str(root / "txt" / "*.txt")
    if kind == "jsonl":
        return str(write_jsonl(root / "corpus.jsonl", DOCS))
    return str(write_parquet(root / "corpus.parquet", DOCS))


@pytest.mark.parametrize("tokenizer", ["byte", "tokenizer.json"])
@pytest.mark.parametrize("source", ["text", "jsonl", "parquet", "tokens .bin", "tokens .npy"])
def test_every_source_and_tokenizer_loads(tmp_path, tok_json, source, tokenizer):
    name = "byte" if tokenizer == "byte" else tok_json
    tok = load_tokenizer(name)
    if source.startswith("tokens"):
        out = tmp_path / "train.bin"
        meta = prepare("jsonl", write_corpus("jsonl", tmp_path), str(out), tokenizer=name,
                       progress=False)
        assert meta["documents"] == len(DOCS) and meta["eos_id"] == tok.eos_id
        files = str(out)
        if source.endswith(".npy"):
            files = str(tmp_path / "train.npy")
            np.save(files, np.fromfile(out, meta["dtype"]))
        config = data_config("tokens", files, tokenizer=name)
    else:
        config = data_config(source, write_corpus(source, tmp_path), tokenizer=name)
    seen = set()
    with make_loader(config, 384, prefetch=0) as loader:
        for _ in range(4):
            batch = next(loader)
            assert set(batch) == set(BATCH_FIELDS)
            assert all(v.shape == (8, 16) and v.dtype == np.int32 for v in batch.values())
            seen.update(np.unique(batch["inputs"]).tolist())
            for r in range(8):
                for piece in unpack({k: v[r] for k, v in batch.items()}):
                    text = tok.decode(piece[piece != tok.eos_id])
                    assert text in CORPUS, (text, piece)
    assert max(seen) < tok.vocab_size and tok.eos_id in seen
    if tokenizer != "byte":
        assert max(seen) > 258  # merged tokens: the tokenizer.json did the work


def test_builtin_corpus_is_the_stdlib_split_by_path():
    train, held_out = sources.builtin_files("train"), sources.builtin_files("eval")
    assert len(train) > 100 and 0 < len(held_out) < len(train) / 5
    assert not set(train) & set(held_out)
    rel = [os.path.relpath(f, sources.stdlib_dir()).split(os.sep) for f in train + held_out]
    assert all(r[-1].endswith(".py") and not {"site-packages", "test"} & set(r) for r in rel)
    with make_loader(data_config("builtin", seq_len=64), 384, prefetch=0) as loader:
        row = {k: v[0] for k, v in loader.batch(0).items()}
    piece = unpack(row)[0]
    text = bytes(piece[piece < 256].tolist())
    assert any(text in open(f, "rb").read() for f in train)


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_shares_are_disjoint_and_tile_the_corpus(tmp_path, kind):
    corpus = sources.open_corpus(kind, write_corpus(kind, tmp_path), "data.files", "text",
                                 seed=1)
    for n in (1, 3, 8, 29):
        cuts = [j * corpus.total // n for j in range(n + 1)]
        docs = [d for a, b in zip(cuts, cuts[1:]) for d in corpus.share(a, b)]
        if kind == "text":
            # Fragments start at line starts and, put together, are every file, whole.
            whole = b"".join(open(f, "rb").read() for f in corpus.files)
            assert b"".join(d.content for d in docs) == whole
            for d in docs:
                assert d.offset == 0 or open(d.path, "rb").read()[d.offset - 1] == ord("\n")
        else:
            assert len({(d.path, d.offset) for d in docs}) == len(docs) == len(DOCS)
            assert sorted(d.content for d in docs) == sorted(DOCS)


def test_prepare_cli_writes_through_a_temp_file(tmp_path, capsys):
    out = tmp_path / "out" / "val.bin"
    assert prepare_main(["--source=text", f"--files={write_corpus('text', tmp_path)}",
                         f"--out={out}", "--quiet"]) == 0
    assert sorted(os.listdir(out.parent)) == ["val.bin", "val.bin.json"]
    tokens = np.fromfile(out, np.uint16)
    assert bytes(tokens[tokens < 256].tolist()).decode() == CORPUS  # files in sorted order
    assert "--config.data.source=tokens" in capsys.readouterr().err
    assert prepare_main(["--source=jsonl", f"--files={tmp_path}/none*.jsonl",
                         f"--out={tmp_path / 'x.bin'}"]) == 2
    assert "matches no file" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.tmp").exists()


# ----- bad input ------------------------------------------------------------------

def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


def _prepared(tmp_path, tokenizer):
    out = str(tmp_path / "t.bin")
    prepare("jsonl", write_corpus("jsonl", tmp_path), out, tokenizer=tokenizer, progress=False)
    return out


def _npy(tmp_path, tokens):
    np.save(tmp_path / "tokens.npy", np.asarray(tokens, np.uint16))
    return str(tmp_path / "tokens.npy")


BAD = {
    "missing file": (lambda p, t: data_config("text", str(p / "missing.txt")),
                     r"data.files: '.*missing.txt': no such file"),
    "empty file": (lambda p, t: data_config("text", _write(p / "empty.txt", "")),
                   r"data.files: .*empty.txt is empty"),
    "glob matches nothing": (lambda p, t: data_config("jsonl", str(p / "*.jsonl")),
                             r"data.files: glob '.*\*.jsonl' matches no file"),
    "a directory": (lambda p, t: data_config("text", str(p)), r"is a directory"),
    "jsonl row without the field": (
        lambda p, t: data_config("jsonl", _write(p / "bad.jsonl", '{"text": "a"}\n\n'
                                                 '{"body": "b"}\n')),
        r"data.files: .*bad.jsonl:3: no 'text' field \(found \['body'\]\); set data.text_field"),
    "jsonl row not json": (
        lambda p, t: data_config("jsonl", _write(p / "bad.jsonl", '{"text": "a"}\n{oops\n')),
        r"bad.jsonl:2: not a JSON object"),
    "jsonl text not a string": (
        lambda p, t: data_config("jsonl", _write(p / "bad.jsonl", '{"text": 5}\n')),
        r"bad.jsonl:1: 'text' is int, not a string"),
    "parquet without the column": (
        lambda p, t: data_config("parquet", str(write_parquet(p / "c.parquet", DOCS, "body"))),
        r"c.parquet has no column 'text' \(columns: \['body', 'id'\]\)"),
    "token id >= vocab": (
        lambda p, t: data_config("tokens", _npy(p, [300 if i % 10 == 0 else 65 + i % 26
                                                    for i in range(1000)]), vocab_size=260),
        r"tokens.npy: token id 300 at token \d+ is not below model.vocab_size=260"),
    "raw token file without sidecar": (
        lambda p, t: data_config("tokens", _write(p / "raw.bin", bytes(400))),
        r"raw.bin is a raw token file without a raw.bin.json sidecar .* data.token_dtype"),
    "token file EOS differs from the tokenizer": (
        lambda p, t: data_config("tokens", _prepared(p, t)),
        r"t.bin was written with EOS id 0 .* data.tokenizer='byte' has EOS id 256"),
    "corpus shorter than one row": (
        lambda p, t: data_config("text", _write(p / "short.txt", "hi\n")),
        r"data.files: the corpus \(.*short.txt\) is shorter than one row: 4 tokens in 1 "
        r"document\(s\), fewer than train.seq_len=16 \+ 1"),
    "token files shorter than one batch": (
        lambda p, t: data_config("tokens", _npy(p, range(100))),
        r"tokens.npy hold 6 rows of train.seq_len=16 \(\+1\) tokens, shorter than one batch"),
    "vocab smaller than the tokenizer": (
        lambda p, t: data_config("text", write_corpus("text", p), vocab_size=256),
        r"model.vocab_size=256 is smaller than data.tokenizer='byte', which has 259 ids"),
    "tokenizer.json missing": (
        lambda p, t: data_config("text", write_corpus("text", p), tokenizer=str(p / "t.json")),
        r"data.tokenizer='.*t.json': no such file"),
    "eos token not in the tokenizer": (
        lambda p, t: data_config("text", write_corpus("text", p), tokenizer=t, eos_token="</s>"),
        r"data.eos_token='</s>' is not a token of this tokenizer"),
    "bad UTF-8 for a tokenizer.json": (
        lambda p, t: data_config("text", _write(p / "bad.txt", b"ok\nline \xff two\n" * 40),
                                 tokenizer=t),
        r"data.files: .*bad.txt:2: not valid UTF-8"),
    "eval without eval files": (
        lambda p, t: _with_eval(data_config("text", write_corpus("text", p))),
        r"train.eval_every=2 needs a validation split: set data.eval_files"),
    "unpacked token files": (
        lambda p, t: data_config("tokens", _npy(p, range(1000)), packing=False),
        r"data.packing=False needs document boundaries"),
    "unknown source": (lambda p, t: data_config("webdataset"), r"data.source='webdataset'"),
    "files for the builtin source": (lambda p, t: data_config("builtin", "a.txt"),
                                     r"data.source='builtin' reads no files"),
}


def _with_eval(config):
    config.train.eval_every = 2
    return config


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_error(tmp_path, tok_json, case):
    make, match = BAD[case]
    config = make(tmp_path, tok_json)
    with pytest.raises(ConfigError, match=match) as e:
        with make_loader(config, config.model.vocab_size) as loader:  # prefetch thread on
            next(loader)
    assert "\n" not in str(e.value)


def test_cheap_data_checks_run_in_experiment_from_config(tmp_path):
    one = jax.devices()[:1]
    with pytest.raises(ConfigError, match="no such file"):
        Experiment.from_config(data_config("text", str(tmp_path / "missing.txt")), one)
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller"):
        Experiment.from_config(data_config("builtin", vocab_size=256), one)
