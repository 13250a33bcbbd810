"""Chat records that only Hugging Face ``datasets`` reads, as a corpus of rows.

Axolotl users keep data in forms ndjax's own readers (``sources``) do not take: a
``save_to_disk`` folder (a ``Dataset``, or a ``DatasetDict`` of split folders), ``.csv``
and ``.arrow`` files, a folder of data files, and a hub dataset id already in the
local cache. ``open_dataset`` loads one of them, with no network, and ``DatasetCorpus``
offers ``sources.Corpus``'s interface over its rows: one unit per row, each document's
content the row (its chosen columns) as a dict.

This module never imports ``sources`` (which opens it: one direction only, see
tests/test_imports.py), so ``sources`` passes its ``Document`` class in; and it imports
``datasets`` inside functions, as only these forms need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ndjax.runtime.errors import ConfigError

DATASET_EXTS = (".csv", ".arrow")  # files that go through ``datasets`` (not ndjax's readers)
_DATA_EXTS = (".jsonl", ".json", ".parquet", *DATASET_EXTS)  # what a data folder holds
_SAVED = ("state.json", "dataset_dict.json")  # save_to_disk: a Dataset, a DatasetDict
_SAVED_META = (*_SAVED, "dataset_info.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# data.eval_files' split of a dataset with several: the held-out ones first, so a spec
# named in both data.files and data.eval_files never evaluates on the training rows.
EVAL_SPLITS = ("validation", "test", "train")
_BATCH = 1024  # rows converted to Python at a time
_FIX = ("give a save_to_disk folder, .csv or .arrow files, a folder of data files or a "
        "cached hub dataset id (docs/data.md)")


def is_dataset_spec(entries: Sequence[str]) -> bool:
    """Whether one of data.files' ``entries`` is a form only ``datasets`` reads: a folder,
    a .csv or .arrow file (by name or glob), a save_to_disk folder's metadata file (an
    error later: the folder is meant), or a hub id that is no local path."""
    for p in entries:
        if glob.has_magic(p):  # the files it matches (ndjax's readers skip folders too)
            if any(_dataset_file(n) or _saved_meta(n) for n in glob.glob(p, recursive=True)):
                return True
        elif os.path.isdir(p) or _dataset_file(p) or _saved_meta(p) or _is_hub_id(p):
            return True
    return False


def _dataset_file(path: str) -> bool:
    return path.endswith(DATASET_EXTS) and os.path.isfile(path)


def _saved_meta(path: str) -> bool:
    """A metadata file of a save_to_disk folder (which a ``*.json`` glob also matches)."""
    folder = os.path.dirname(path) or "."
    return os.path.basename(path) in _SAVED_META and _is_saved(folder)


def _is_saved(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in _SAVED)


def _is_hub_id(p: str) -> bool:
    return (not os.path.exists(p) and not glob.has_magic(p) and not p.endswith(_DATA_EXTS)
            and _HUB_ID.fullmatch(p) is not None)


@dataclasses.dataclass(frozen=True)
class DatasetCorpus:
    """The rows of one split of a ``datasets.Dataset``; units are rows."""

    spec: str        # data.files' value, as written: documents' path
    field: str       # the config field that named it, for errors
    key: str         # what the fingerprint hashes: stable across processes and machines
    dataset: Any = dataclasses.field(compare=False, repr=False)  # a datasets.Dataset
    document: Callable[..., Any] = dataclasses.field(compare=False, repr=False)
    columns: tuple[str, ...] = ()  # those of the requested columns the dataset has
    kind: str = "dataset"

    @property
    def files(self) -> tuple[str, ...]:
        return (self.spec,)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.total,)

    @property
    def total(self) -> int:
        return len(self.dataset)

    def fingerprint(self) -> int:
        """A small int that changes when the data (or the split read) changes."""
        return zlib.crc32(self.key.encode())

    def share(self, lo: int, hi: int) -> Iterator[Any]:
        """Rows ``[lo, hi)`` in order, each a ``Document`` holding the row as a dict."""
        lo, hi = max(lo, 0), min(hi, self.total)
        for a in range(lo, hi, _BATCH):
            batch = self.dataset[a:min(hi, a + _BATCH)]  # columns -> lists
            names = list(batch)
            for i, values in enumerate(zip(*(batch[n] for n in names))):
                yield self.document(dict(zip(names, values)), self.spec, a + i, self.kind,
                                    self.field)


def open_dataset(entries: Sequence[str], field: str, split: str, columns: tuple[str, ...],
                 document: Callable[..., Any]) -> DatasetCorpus:
    """Loads data.files' ``entries`` (one dataset) with no network; ``split`` is ndjax's
    'train' or 'eval'. Every failure is one ConfigError naming ``field`` and the value."""
    spec = ",".join(entries)
    with _offline():
        try:
            ds, key = _load(entries, spec, field, split)
        except ConfigError:
            raise
        except Exception as e:  # datasets and pyarrow raise many kinds: one line each
            lines = str(e).strip().splitlines() or [""]
            raise ConfigError(f"{field}: {spec!r}: Hugging Face datasets could not read it "
                              f"({type(e).__name__}: {lines[0]}); {_FIX}.") from None
    present = tuple(c for c in columns if c in ds.column_names)
    if columns and not present:
        raise ConfigError(f"{field}: {spec!r} has none of the columns {list(columns)} "
                          f"(columns: {ds.column_names}); set data.messages_field, or "
                          "data.prompt_field and data.completion_field.")
    if present:
        ds = ds.select_columns(list(present))
    if len(ds) == 0:
        raise ConfigError(f"{field}: {spec!r} has no rows.")
    return DatasetCorpus(spec, field, key, ds, document, present)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub look-ups for the call. ``datasets`` and ``huggingface_hub`` read
    HF_HUB_OFFLINE into module flags when first imported, so setting the variable now
    would change nothing; their flags are set and put back instead."""
    import datasets.config
    import huggingface_hub.constants as hub

    config = datasets.config
    saved = config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _load(entries: Sequence[str], spec: str, field: str, split: str) -> tuple[Any, str]:
    """(the Dataset of ``split``, its fingerprint key)."""
    import datasets

    files, others = [], []
    for p in entries:
        if glob.has_magic(p):
            found = sorted(m for m in glob.glob(p, recursive=True) if os.path.isfile(m))
            if not found:
                raise ConfigError(f"{field}: glob {p!r} matches no file.")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        elif os.path.isdir(p) or _is_hub_id(p):
            others.append(p)
        else:
            raise ConfigError(f"{field}: {p!r}: no such file or folder.")
    for f in files:
        if _saved_meta(f):
            raise ConfigError(f"{field}: {f} is the metadata of a datasets save_to_disk "
                              f"folder, not data; name the folder: "
                              f"{field}={os.path.dirname(f) or '.'}.")
    exts = sorted({os.path.splitext(f)[1] for f in files})
    if len(others) + bool(files) > 1 or not set(exts) <= set(DATASET_EXTS) or len(exts) > 1:
        raise ConfigError(f"{field}: {spec!r} mixes kinds of data ({', '.join(others + exts)}"
                          "); give one dataset per field: one folder or hub id, or .csv or "
                          ".arrow files of one kind (not beside .jsonl or .parquet files).")
    if files:
        dd = datasets.load_dataset(exts[0][1:], data_files=files)  # csv or arrow
        name = _pick_split(list(dd), split, spec, field)
        return dd[name], f"files:{_sizes(files)}:{name}"
    p = others[0]
    if os.path.isdir(p) and _is_saved(p):
        loaded = datasets.load_from_disk(p)
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            name = _pick_split(splits, split, spec, field, "name one split's folder, e.g. "
                               f"{field}={os.path.join(p, splits[0])}")
            loaded = loaded[name]
        return loaded, f"saved:{loaded._fingerprint}"
    if os.path.isdir(p):
        data = sorted(os.path.join(d, n) for d, _, names in os.walk(p) for n in names
                      if n.endswith(_DATA_EXTS))
        if not data:
            raise ConfigError(f"{field}: {p!r} is a folder with no data files "
                              f"({', '.join(_DATA_EXTS)}) and no save_to_disk dataset; {_FIX}.")
        dd = datasets.load_dataset(p)  # its README or file names give the splits
        name = _pick_split(list(dd), split, spec, field)
        return dd[name], f"folder:{_sizes(data, p)}:{name}"
    return _hub(p, field, split)


def _hub(repo: str, field: str, split: str) -> tuple[Any, str]:
    """A hub dataset from the local caches: the hub's (``hf download``, or what
    ``load_dataset`` downloaded), read as a folder; else the prepared Arrow files a
    past ``load_dataset`` (Axolotl's) left in the datasets cache."""
    import datasets
    from huggingface_hub import snapshot_download

    failed: Exception | None = None
    try:
        folder = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except Exception:  # not cached (or not a valid id): try the datasets cache
        folder = None
    if folder is not None:
        try:
            dd = datasets.load_dataset(folder)
        except Exception as e:  # e.g. only some of its files: a prepared copy may do
            failed = e
        else:
            name = _pick_split(list(dd), split, repo, field)
            return dd[name], f"hub:{repo}@{os.path.basename(folder)}:{name}"
    try:
        dd = datasets.load_dataset(repo)
    except ConnectionError:  # what offline mode raises for an id in neither cache
        if failed is not None:
            raise failed from None
        raise ConfigError(
            f"{field}: {repo!r} is no local file or folder, and no Hugging Face dataset of "
            "that id is in the local cache (ndjax does not download); fix the path, or run "
            f"`hf download {repo} --repo-type dataset` (then run again).") from None
    name = _pick_split(list(dd), split, repo, field)
    return dd[name], f"cached:{dd[name]._fingerprint}"


def _pick_split(splits: list[str], split: str, spec: str, field: str,
                fix: str = "save the split to read with save_to_disk (e.g. "
                           "dataset_dict['name'].save_to_disk(folder)) and name that folder"
                ) -> str:
    """ndjax's 'train' -> "train"; 'eval' -> "validation", else "test", else "train";
    a dataset of one split is read whole for either."""
    if len(splits) == 1:
        return splits[0]
    wanted = ("train",) if split == "train" else EVAL_SPLITS
    for name in wanted:
        if name in splits:
            return name
    raise ConfigError(f"{field}: {spec!r} has the splits {splits}, none of them "
                      f"{' or '.join(repr(w) for w in wanted)}; {fix}.")


def _sizes(files: list[str], root: str | None = None) -> str:
    """Names (relative to ``root``, else base names) and sizes: the same on every machine
    that holds the same files, unlike the modification times ``datasets`` hashes."""
    name = (lambda f: os.path.relpath(f, root)) if root else os.path.basename  # noqa: E731
    return ",".join(sorted(f"{name(f)}:{os.path.getsize(f)}" for f in files))
