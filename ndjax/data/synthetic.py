"""A deterministic, learnable token source that needs no files.

Rows are packed documents drawn from a fixed random Markov chain: each token
is followed by its successor in a seeded permutation with probability
``follow``, else by a uniform random token. A model can learn the chain, so the
loss visibly falls from ln(vocab) towards the chain's entropy. Documents use
at most ``alphabet`` distinct tokens (byte-sized by default), so a small model
learns the chain within a few hundred steps on a CPU. Every row is a
pure function of (seed, step, row), so the batches are identical whatever the
mesh layout, the number of hosts, or a restart.
"""

from __future__ import annotations

import numpy as np

from ndjax.data.packing import packed_fields

EOS = 0


class SyntheticSource:
    def __init__(self, vocab_size: int, seq_len: int, seed: int, *,
                 follow: float = 0.9, mean_doc_len: int = 96, alphabet: int = 255,
                 split: int = 0, max_runs: int | None = None):
        self.vocab_size, self.seq_len, self.seed, self.split = vocab_size, seq_len, seed, split
        self.max_runs = max_runs  # documents per row at most: the last one fills the row
        self.follow, self.mean_doc_len = follow, mean_doc_len
        self.alphabet = min(alphabet, vocab_size - 1)  # tokens 1..alphabet; 0 is EOS
        perm = np.random.default_rng([seed, 0x5EED]).permutation(self.alphabet)
        self.successor = np.concatenate([[1], perm + 1])  # successor[token]

    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]:
        """Rows ``start .. start+count`` of the global batch of ``step``."""
        n = self.seq_len + 1
        stream = np.empty((count, n), np.int32)
        doc = np.empty((count, n), np.int32)
        for i in range(count):
            key = [self.seed, step, start + i] + ([self.split] if self.split else [])
            rng = np.random.default_rng(key)
            stream[i], doc[i] = self._row(rng, n)
        # Document ids are 1, 2, ... per row, exactly the segment ids packing assigns.
        return packed_fields(stream, doc)

    def _row(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        follow = rng.random(n) < self.follow
        noise = rng.integers(1, self.alphabet + 1, n)
        lengths = rng.geometric(1.0 / self.mean_doc_len, size=n)
        tokens = np.empty(n, np.int64)
        doc = np.empty(n, np.int32)
        pos, d = 0, 0
        while pos < n:
            end = min(pos + int(lengths[d]) + 1, n)  # document body then EOS
            if d + 1 == self.max_runs:
                end = n
            tok = noise[pos]
            for t in range(pos, end - 1):
                tokens[t] = tok
                tok = self.successor[tok] if follow[t] else noise[t]
            tokens[end - 1] = EOS
            doc[pos:end] = d + 1
            pos, d = end, d + 1
        return tokens.astype(np.int32), doc
