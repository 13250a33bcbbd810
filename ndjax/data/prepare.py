"""Pre-tokenize a corpus into a flat token file (nanoGPT style) and a JSON sidecar.

    ndjax prepare --source=jsonl --files='corpus/*.jsonl' \\
        --tokenizer=tokenizer.json --out=data/train.bin

writes ``data/train.bin`` (every document's ids followed by EOS, uint16 when the
vocabulary fits, else uint32) and ``data/train.bin.json`` (dtype, token count,
EOS id, largest id), through temporary files renamed at the end, so an
interrupted run never leaves a half-written file under the final name. Train
on it with ``--config.data.source=tokens --config.data.files=data/train.bin``
and the same ``--config.data.tokenizer`` (its EOS id separates documents).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from ndjax.data import sources
from ndjax.data.tokenizers import load_tokenizer, token_dtype
from ndjax.runtime.errors import ConfigError

_BATCH = 256  # documents per encode_batch call


def prepare(source: str, files: str, out: str, *, tokenizer: str = "byte", eos_token: str = "",
            text_field: str = "text", split: str = "train", progress: bool = True
            ) -> dict[str, object]:
    """Tokenizes every document of the corpus into ``out``; returns the sidecar's contents."""
    if source not in sources.TEXT_KINDS:
        raise ConfigError(f"--source={source!r}: choose one of {', '.join(sources.TEXT_KINDS)}.")
    if source == "builtin" and files:
        raise ConfigError("--source=builtin reads the stdlib, not --files; did you mean "
                          "--source=text, jsonl or parquet?")
    corpus = sources.open_corpus(source, files, "--files", text_field, split)
    tok = load_tokenizer(tokenizer, eos_token)
    dtype = token_dtype(tok.vocab_size)
    base = dict(zip(corpus.files, np.cumsum((0, *corpus.sizes[:-1])).tolist()))
    n_tokens = n_docs = max_id = 0
    tmp_bin, tmp_meta = out + ".tmp", sources.sidecar_path(out) + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    unit = "row" if source == "parquet" else "B"
    try:
        with open(tmp_bin, "wb") as f, tqdm(total=corpus.total, unit=unit, unit_scale=True,
                                            desc=os.path.basename(out),
                                            disable=not progress) as bar:
            batch: list[sources.Document] = []

            def flush() -> None:
                nonlocal n_tokens, n_docs, max_id
                texts = [d.content if tok.takes_bytes else d.text() for d in batch]
                for ids in tok.encode_batch(texts):
                    if len(ids):
                        f.write(np.append(ids, tok.eos_id).astype(dtype).tobytes())
                        n_tokens, n_docs = n_tokens + len(ids) + 1, n_docs + 1
                        max_id = max(max_id, int(ids.max()), tok.eos_id)
                last = batch[-1]
                bar.update(base[last.path] + last.offset - bar.n)
                batch.clear()

            for doc in corpus.share(0, corpus.total):
                batch.append(doc)
                if len(batch) == _BATCH:
                    flush()
            if batch:
                flush()
            bar.update(corpus.total - bar.n)
        if n_tokens == 0:
            raise ConfigError(f"--files: the corpus ({', '.join(corpus.files)}) has no text.")
        meta = {"format": sources.SIDECAR_FORMAT, "dtype": dtype.name, "tokens": n_tokens,
                "documents": n_docs, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "max_id": max_id, "tokenizer": tok.name}
        with open(tmp_meta, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp_bin, out)
        os.replace(tmp_meta, sources.sidecar_path(out))
    finally:
        for tmp in (tmp_bin, tmp_meta):
            if os.path.exists(tmp):
                os.remove(tmp)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ndjax prepare",
                                description=__doc__.splitlines()[0])
    p.add_argument("--source", default="builtin", help=", ".join(sources.TEXT_KINDS))
    p.add_argument("--files", default="", help="comma-separated paths or globs")
    p.add_argument("--split", default="train", choices=("train", "eval"),
                   help="builtin only: which split")
    p.add_argument("--text_field", default="text", help="JSON Lines key / Parquet column")
    p.add_argument("--tokenizer", default="byte", help="byte, or a tokenizer.json path")
    p.add_argument("--eos_token", default="", help="a tokenizer.json's end-of-document token")
    p.add_argument("--out", required=True, help="the token file to write, e.g. data/train.bin")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        meta = prepare(a.source, a.files, a.out, tokenizer=a.tokenizer, eos_token=a.eos_token,
                       text_field=a.text_field, split=a.split, progress=not a.quiet)
    except ConfigError as e:
        print(f"prepare: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {meta['tokens']} tokens ({meta['documents']} documents, {meta['dtype']}) to "
          f"{a.out}; train with --config.data.source=tokens --config.data.files={a.out} "
          f"--config.data.tokenizer={a.tokenizer}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
