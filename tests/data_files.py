"""Small corpora written by the tests: text, JSON Lines, Parquet, token files, a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import tiny_config

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def texts(n: int = 24, seed: int = 0) -> list[str]:
    """``n`` distinct ASCII documents of a few lines each (~60-250 bytes)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS, rng.integers(3, 9))) for _ in range(rng.integers(1, 5))]
        out.append(f"doc {i}: " + "\n".join(lines))
    return out


def write_text(folder: Path, docs: list[str], per_file: int = 5) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(0, len(docs), per_file):
        p = folder / f"part{k // per_file:02d}.txt"
        p.write_text("\n".join(docs[k:k + per_file]) + "\n")
        paths.append(p)
    return paths


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: docs, "id": list(range(len(docs)))}), path,
                   row_group_size=5)  # several row groups: shares cut across them
    return path


def write_tokenizer(path: Path, docs: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained on ``docs`` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return path


def data_config(source: str, files: str = "", *, vocab_size: int = 384, batch_size: int = 8,
                seq_len: int = 16, **data):
    c = tiny_config(model=dict(vocab_size=vocab_size),
                    train=dict(batch_size=batch_size, seq_len=seq_len))
    c.data.source = source
    c.data.files = files
    c.data.update(data)
    return c
