"""Where documents come from, read whole or by ranges of the corpus.

A text corpus (``builtin``, ``text``, ``jsonl``, ``parquet``) is a list of files
laid end to end in one *unit space*: bytes for text and JSON Lines, rows for
Parquet. ``Corpus.share(lo, hi)`` reads the documents that start inside units
``[lo, hi)`` and nothing else, so disjoint ranges give disjoint documents and
ranges that tile ``[0, total)`` give the whole corpus. Byte ranges are snapped
to line starts (a range owns the lines that begin in it), so a JSON Lines
record or a UTF-8 character is never cut; a plain-text file that spans two
ranges becomes two documents, split at a newline.

Opening a corpus only lists files and reads sizes and Parquet footers: the
cheap checks (missing or empty files, a glob that matches nothing, a missing
Parquet column) run before anything is read or compiled. Pre-tokenized token
files are described by ``TokenFile``.

Chat data (``open_corpus('chat', ...)``) is JSON Lines or Parquet read as
*records*: each document's content is the whole JSON object (or the row's
chosen columns) as a dict, which ``ndjax.data.chat`` turns into a conversation.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator

import numpy as np

from ndjax.data import hf_datasets  # light: it imports ``datasets`` only when used
from ndjax.runtime.errors import ConfigError

TEXT_KINDS = ("builtin", "text", "jsonl", "parquet")
RECORD_KINDS = ("chat",)  # JSON Lines or Parquet (by extension), read as records
# Directories of the stdlib that are not the library itself (installed
# packages differ between machines; tests contain deliberately broken files).
_BUILTIN_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
BUILTIN_EVAL_EVERY = 20  # one file in ~20 (by a hash of its path) is validation
_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class Document:
    content: bytes | str | dict  # dict: a record (chat data)
    path: str
    offset: int  # byte offset in the file (text, jsonl) or row index (parquet)
    kind: str
    field: str = "data.files"  # the config field that named the file, for errors

    def where(self, extra: int = 0) -> str:
        """``path:line`` (``path row N`` for Parquet and ``datasets`` rows), for error
        messages."""
        if self.kind in ("parquet", "dataset"):
            return f"{self.path} row {self.offset}"
        return f"{self.path}:{line_number(self.path, self.offset + extra)}"

    def text(self) -> str:
        """The content as str; bad UTF-8 is an error naming the file and line."""
        if isinstance(self.content, str):
            return self.content
        try:
            return self.content.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.field}: {self.where(e.start)}: not valid UTF-8 "
                              f"({e.reason}); a tokenizer.json needs text. Fix the file or use "
                              "data.tokenizer=byte.") from None


def line_number(path: str, offset: int) -> int:
    """1-based line of byte ``offset``. Only called for an error message, so reading the
    file up to there is fine."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(_CHUNK, offset))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count + 1


def split_patterns(spec: str) -> list[str]:
    return [p.strip() for p in spec.split(",") if p.strip()]


def resolve_files(spec: str, field: str) -> list[str]:
    """Comma-separated paths and globs -> sorted existing, non-empty files."""
    patterns = split_patterns(spec)
    if not patterns:
        raise ConfigError(f"{field} is empty: give one or more comma-separated paths or globs, "
                          f"e.g. {field}='corpus/*.txt'.")
    files: set[str] = set()
    for p in patterns:
        if glob.has_magic(p):
            matches = [m for m in glob.glob(p, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise ConfigError(f"{field}: glob {p!r} matches no file.")
            files.update(matches)
        elif os.path.isdir(p):
            raise ConfigError(f"{field}: {p!r} is a directory; give a glob such as "
                              f"'{p.rstrip('/')}/*.txt'.")
        elif not os.path.isfile(p):
            raise ConfigError(f"{field}: {p!r}: no such file.")
        else:
            files.add(p)
    for f in sorted(files):
        if os.path.getsize(f) == 0:
            raise ConfigError(f"{field}: {f} is empty.")
    return sorted(files)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def builtin_files(split: str) -> list[str]:
    """The interpreter's own standard library .py files of ``split`` ('train' or 'eval').

    Sorted by relative path, and split by a hash of that path, so the split is
    the same on every machine with the same Python and never depends on order.
    """
    root = stdlib_dir()
    chosen = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _BUILTIN_SKIP)
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            is_eval = zlib.crc32(rel.encode()) % BUILTIN_EVAL_EVERY == 0
            if is_eval == (split == "eval") and os.path.getsize(path) > 0:
                chosen.append((rel, path))
    if not chosen:
        raise ConfigError(f"data.source='builtin': found no {split} .py files in this Python's "
                          f"standard library ({root}); use data.source=text with data.files.")
    return [path for _, path in sorted(chosen)]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Text files laid end to end; ``sizes`` are bytes (rows for Parquet)."""

    kind: str
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    field: str        # the config field that named the files, for errors
    text_field: str   # JSON Lines key / Parquet column
    # Non-empty: documents are records (dicts) holding these Parquet columns (those a
    # file has; JSON Lines records are whole), not the text of ``text_field``.
    columns: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def fingerprint(self) -> int:
        """A small int that changes when the files (names or sizes) change."""
        items = sorted(f"{os.path.basename(f)}:{s}" for f, s in zip(self.files, self.sizes))
        return zlib.crc32("\n".join(items).encode())

    def share(self, lo: int, hi: int) -> Iterator[Document]:
        """The documents that start in units ``[lo, hi)``, in order."""
        offset = 0
        for path, size in zip(self.files, self.sizes):
            a, b = max(lo, offset) - offset, min(hi, offset + size) - offset
            offset += size
            if a < b:
                if self.kind == "parquet":
                    yield from _parquet_rows(path, a, b, self.text_field, self.field,
                                             self.columns)
                else:
                    yield from self._read_lines(path, a, b, size)
            if offset >= hi:
                return

    def _read_lines(self, path: str, a: int, b: int, size: int) -> Iterator[Document]:
        with open(path, "rb") as f:
            start = 0 if a == 0 else _line_start_at_or_after(f, a, size)
            end = size if b == size else _line_start_at_or_after(f, b, size)
            if start >= end:
                return
            f.seek(start)
            data = f.read(end - start)
        if self.kind != "jsonl":
            yield Document(data, path, start, self.kind, self.field)
            return
        pos = 0
        for line in data.split(b"\n"):
            if line.strip():
                content = (self._json_record(line, path, start + pos) if self.columns
                           else self._json_text(line, path, start + pos))
                yield Document(content, path, start + pos, "jsonl", self.field)
            pos += len(line) + 1

    def _json_record(self, line: bytes, path: str, offset: int) -> dict:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "bad UTF-8"
            record, found = None, f" ({reason})"
        else:
            found = f" (found {type(record).__name__})"
        if not isinstance(record, dict):
            raise ConfigError(f"{self.field}: {path}:{line_number(path, offset)}: not a JSON "
                              f"object{found}.")
        return record

    def _json_text(self, line: bytes, path: str, offset: int) -> str:
        where = lambda: f"{self.field}: {path}:{line_number(path, offset)}"  # noqa: E731
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "bad UTF-8"
            raise ConfigError(f"{where()}: not a JSON object ({reason}).") from None
        if not isinstance(record, dict) or self.text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ConfigError(f"{where()}: no {self.text_field!r} field (found {keys}); set "
                              "data.text_field to the key that holds the text.")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise ConfigError(f"{where()}: {self.text_field!r} is {type(text).__name__}, "
                              "not a string.")
        return text


def _line_start_at_or_after(f, pos: int, size: int) -> int:
    """The first line start >= ``pos`` (0 < pos < size): just past the first newline
    at or after ``pos - 1``, or ``size`` if there is none."""
    f.seek(pos - 1)
    at = pos - 1
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            return size
        i = chunk.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(chunk)


def _pyarrow_parquet(field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{field}: reading Parquet needs pyarrow: "
                          "pip install 'ndjax[parquet]'.") from None
    return pq


def _parquet_file(path: str, text_field: str, field: str, columns: tuple[str, ...] = ()):
    pq = _pyarrow_parquet(field)
    import pyarrow as pa
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise ConfigError(f"{field}: {path} is not a Parquet file ({e}).") from None
    schema = pf.schema_arrow
    if columns:  # records: the row's types are checked where the record is used
        if not set(columns) & set(schema.names):
            raise ConfigError(f"{field}: {path} has none of the columns {list(columns)} "
                              f"(columns: {schema.names}); set data.messages_field, or "
                              "data.prompt_field and data.completion_field.")
        return pf
    if text_field not in schema.names:
        raise ConfigError(f"{field}: {path} has no column {text_field!r} (columns: "
                          f"{schema.names}); set data.text_field.")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"{field}: {path} column {text_field!r} is {kind}, not a string.")
    return pf


def _parquet_rows(path: str, a: int, b: int, text_field: str, field: str,
                  columns: tuple[str, ...] = ()) -> Iterator[Document]:
    """Rows ``[a, b)``: the text of ``text_field``, or (``columns`` given) a dict of those
    of ``columns`` the file has."""
    pf = _parquet_file(path, text_field, field, columns)
    present = [c for c in columns if c in pf.schema_arrow.names]
    row = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row < b and row + n > a:
            table = pf.read_row_group(g, columns=present or [text_field])
            values = table.to_pylist() if present else table.column(0).to_pylist()
            for i in range(max(a, row) - row, min(b, row + n) - row):
                if values[i] is None:
                    raise ConfigError(f"{field}: {path} row {row + i}: {text_field!r} is null.")
                yield Document(values[i], path, row + i, "parquet", field)
        row += n
        if row >= b:
            return


def open_corpus(kind: str, spec: str, field: str, text_field: str, split: str = "train",
                seed: int | None = None, columns: tuple[str, ...] = ()
                ) -> Corpus | hf_datasets.DatasetCorpus:
    """Lists and sizes the files (reading no contents). ``seed`` shuffles the file order
    (the documents are shuffled again each epoch, ``streams``). ``kind``
    'chat' reads ``columns`` of Parquet files, or JSON Lines records, as dicts; a
    save_to_disk folder, .csv or .arrow files, a folder of data files or a cached hub id
    go through Hugging Face ``datasets`` instead (``hf_datasets``: it loads them)."""
    if kind in RECORD_KINDS:
        if hf_datasets.is_dataset_spec(split_patterns(spec)):
            return hf_datasets.open_dataset(split_patterns(spec), field, split, columns,
                                            Document)
    if kind == "builtin":
        files = builtin_files(split)
        field = "data.source='builtin'"
    else:
        files = resolve_files(spec, field)
    if kind in RECORD_KINDS:
        parquet = [f.endswith(".parquet") for f in files]
        if any(parquet) and not all(parquet):
            raise ConfigError(f"{field}: mixes .parquet and JSON Lines files ({_some(files)}); "
                              "give one kind of file per split.")
        kind = "parquet" if all(parquet) else "jsonl"
    else:
        columns = ()
    if kind == "parquet":
        sizes = [_parquet_file(f, text_field, field, columns).metadata.num_rows for f in files]
        for f, n in zip(files, sizes):
            if n == 0:
                raise ConfigError(f"{field}: {f} has no rows.")
    else:
        sizes = [os.path.getsize(f) for f in files]
    order = range(len(files)) if seed is None else np.random.default_rng(
        [seed, 0xF11E5]).permutation(len(files))
    return Corpus(kind, tuple(files[i] for i in order), tuple(sizes[i] for i in order), field,
                  text_field, tuple(columns))


def _some(files: list[str]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


# ----- pre-tokenized token files ------------------------------------------------

TOKEN_DTYPES = ("uint16", "uint32")
SIDECAR_FORMAT = "ndjax.tokens/1"


def sidecar_path(path: str) -> str:
    return path + ".json"


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A flat array of token ids (raw binary, nanoGPT style, or ``.npy``), memory-mapped.

    ``prepare`` writes a ``<file>.json`` sidecar next to a raw file with its
    dtype, length, EOS id and largest id, so those are checked without a scan.
    """

    path: str
    dtype: np.dtype
    n_tokens: int
    eos_id: int | None   # from the sidecar
    max_id: int | None   # from the sidecar

    def array(self) -> np.ndarray:
        if self.path.endswith(".npy"):
            return np.load(self.path, mmap_mode="r")
        return np.memmap(self.path, dtype=self.dtype, mode="r")


def open_token_files(spec: str, field: str, token_dtype: str) -> list[TokenFile]:
    if token_dtype not in ("auto", *TOKEN_DTYPES):
        raise ConfigError(f"data.token_dtype={token_dtype!r}: choose auto, uint16 or uint32.")
    return [_token_file(f, field, token_dtype) for f in resolve_files(spec, field)]


def _token_file(path: str, field: str, token_dtype: str) -> TokenFile:
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise ConfigError(f"{field}: {path} is not a valid .npy file ({e}).") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ConfigError(f"{field}: {path} holds {arr.dtype} of shape {arr.shape}; token "
                              "files must be 1-D integer arrays.")
        if arr.size == 0:
            raise ConfigError(f"{field}: {path} is empty.")
        return TokenFile(path, arr.dtype, int(arr.size), None, None)
    meta: dict = {}
    if os.path.isfile(sidecar_path(path)):
        with open(sidecar_path(path)) as f:
            try:
                meta = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{field}: {sidecar_path(path)} is not valid JSON "
                                  f"({e.msg}).") from None
        if meta.get("format") != SIDECAR_FORMAT:
            raise ConfigError(f"{field}: {sidecar_path(path)} is not a token-file sidecar "
                              f"(format {meta.get('format')!r}, expected {SIDECAR_FORMAT!r}).")
    dtype = meta.get("dtype") if token_dtype == "auto" else token_dtype
    if dtype is None:
        raise ConfigError(f"{field}: {path} is a raw token file without a "
                          f"{os.path.basename(sidecar_path(path))} sidecar giving its dtype; set "
                          "data.token_dtype=uint16 or uint32.")
    if meta and meta["dtype"] != dtype:
        raise ConfigError(f"{field}: data.token_dtype={dtype} but {sidecar_path(path)} says "
                          f"{meta['dtype']}; set data.token_dtype=auto.")
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise ConfigError(f"{field}: {path} has {size} bytes, not a whole number of {dtype} "
                          "tokens; is data.token_dtype right?")
    if meta and meta["tokens"] != size // itemsize:
        raise ConfigError(f"{field}: {path} holds {size // itemsize} tokens but its sidecar "
                          f"says {meta['tokens']}; the file changed: run prepare again.")
    return TokenFile(path, np.dtype(dtype), size // itemsize, meta.get("eos_id"),
                     meta.get("max_id"))
