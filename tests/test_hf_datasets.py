"""Chat records read through Hugging Face ``datasets`` (issue 48): save_to_disk folders,
.csv and .arrow files, folders of data files and hub ids in the local cache give their
rows in order, by ranges, with a stable fingerprint; what cannot be read is one line.

Every asset is written with ``datasets`` itself into tmp_path, and both Hugging Face
caches point there too (``hf_cache``): nothing reads or writes the user's cache, and no
test touches the network. The hub cache is faked by its on-disk layout (refs/main and a
snapshot folder, as ``hf download`` leaves it); the datasets cache by a builder's
prepared Arrow files placed under the id (as a past ``load_dataset`` leaves them).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets  # a dependency of ndjax (pyproject.toml)
import pytest
from data_files import conversations, data_config, write_chat_jsonl, write_chat_tokenizer

from ndjax.data import sources
from ndjax.data.loader import make_loader
from ndjax.runtime.errors import ConfigError

COLUMNS = ("messages", "prompt", "completion")  # what data.source=chat asks for
ROWS = [{"prompt": f"question {i}?", "completion": f"answer {i}.", "extra": i} for i in range(7)]
WANT = [{"prompt": r["prompt"], "completion": r["completion"]} for r in ROWS]  # COLUMNS kept
HELD_OUT = ROWS[:3]  # a DatasetDict's "test" split
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Both caches under tmp_path: the variables for new processes, and the module flags
    ``datasets`` and ``huggingface_hub`` read them into when first imported."""
    import huggingface_hub.constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def _dataset(rows):
    return datasets.Dataset.from_list(rows)


def saved(root):
    _dataset(ROWS).save_to_disk(str(root / "saved"))
    return str(root / "saved")


def saved_dict(root):
    datasets.DatasetDict(train=_dataset(ROWS), test=_dataset(HELD_OUT)).save_to_disk(
        str(root / "saved_dict"))
    return str(root / "saved_dict")


def csv_file(root):
    _dataset(ROWS).to_csv(str(root / "rows.csv"))
    return str(root / "rows.csv")


def arrow_file(root):
    """The Arrow file a save_to_disk folder holds, on its own."""
    _dataset(ROWS).save_to_disk(str(root / "tmp"))
    shutil.copy(root / "tmp" / "data-00000-of-00001.arrow", root / "rows.arrow")
    return str(root / "rows.arrow")


def jsonl_folder(root):
    for k, part in enumerate((ROWS[:4], ROWS[4:])):
        _dataset(part).to_json(str(root / "folder" / f"part{k}.jsonl"))
    return str(root / "folder")


def hub_download(root, repo="org/chats"):
    """``hf download`` 's layout in the hub cache: refs/main names a snapshot folder."""
    import huggingface_hub.constants

    entry = Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(SHA)
    data = entry / "snapshots" / SHA / "data"
    _dataset(ROWS).to_json(str(data / "train.jsonl"))
    _dataset(HELD_OUT).to_json(str(data / "test.jsonl"))
    return repo


def hub_prepared(root, repo="org/prepared"):
    """A past ``load_dataset(repo)``'s prepared Arrow files in the datasets cache,
    ``<org>___<name>/<config>/<version>/<hash>/`` (without the hub cache)."""
    from datasets.packaged_modules.json.json import Json

    _dataset(ROWS).to_json(str(root / "src.jsonl"))
    name = repo.split("/")[1]
    builder = Json(dataset_name=name, data_files={"train": str(root / "src.jsonl")},
                   cache_dir=str(root / "build"))
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, Path(datasets.config.HF_DATASETS_CACHE) /
                    repo.replace("/", "___") / "default" / "0.0.0" / "somehash")
    return repo


FORMS = {"save_to_disk Dataset": saved, "save_to_disk DatasetDict": saved_dict,
         "csv": csv_file, "arrow": arrow_file, "folder of jsonl": jsonl_folder,
         "hub id, hf download": hub_download, "hub id, prepared cache": hub_prepared}


def open_chat(spec, split="train", field="data.files"):
    return sources.open_corpus("chat", spec, field, "text", split, columns=COLUMNS)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_gives_its_rows_in_order_by_ranges(tmp_path, form):
    spec = FORMS[form](tmp_path)
    corpus = open_chat(spec)
    assert corpus.kind == "dataset" and corpus.total == len(ROWS) and corpus.files == (spec,)
    docs = list(corpus.share(0, corpus.total))
    assert [d.content for d in docs] == WANT
    assert [d.offset for d in docs] == list(range(len(ROWS)))
    assert docs[5].where() == f"{spec} row 5" and docs[5].field == "data.files"
    for lo in range(len(ROWS)):
        for hi in range(lo + 1, len(ROWS) + 1):
            assert [d.content for d in corpus.share(lo, hi)] == WANT[lo:hi], (lo, hi)
    assert open_chat(spec).fingerprint() == corpus.fingerprint()


def test_fingerprints_are_the_same_in_another_process(tmp_path):
    specs = []
    for k, form in enumerate(sorted(FORMS)):
        (tmp_path / str(k)).mkdir()
        specs.append(FORMS[form](tmp_path / str(k)))
    here = [open_chat(s).fingerprint() for s in specs]
    code = ("import sys\nfrom ndjax.data import sources\n"
            "print([sources.open_corpus('chat', s, 'data.files', 'text', columns=('prompt',))"
            ".fingerprint() for s in sys.argv[1:]])")
    out = subprocess.run([sys.executable, "-c", code, *specs], capture_output=True, text=True,
                         check=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_fingerprints_change_with_the_data(tmp_path):
    before = [open_chat(saved(tmp_path)).fingerprint(), open_chat(csv_file(tmp_path)).fingerprint()]
    shutil.rmtree(tmp_path / "saved")
    _dataset(ROWS[:-1]).save_to_disk(str(tmp_path / "saved"))
    _dataset(ROWS[:-1]).to_csv(str(tmp_path / "rows.csv"))
    after = [open_chat(str(tmp_path / "saved")).fingerprint(),
             open_chat(str(tmp_path / "rows.csv")).fingerprint()]
    assert before[0] != after[0] and before[1] != after[1]


@pytest.mark.parametrize("form", ["save_to_disk DatasetDict", "hub id, hf download"])
def test_eval_reads_the_held_out_split(tmp_path, form):
    spec = FORMS[form](tmp_path)
    train, held = open_chat(spec), open_chat(spec, "eval", "data.eval_files")
    assert held.total == len(HELD_OUT) and held.field == "data.eval_files"
    assert [d.content for d in held.share(0, held.total)] == WANT[:len(HELD_OUT)]
    assert train.fingerprint() != held.fingerprint()
    # A dataset of one split is read whole for either.
    one = saved(tmp_path)
    assert open_chat(one, "eval").total == len(ROWS)
    # A split folder of a DatasetDict is a save_to_disk Dataset of its own.
    if form.startswith("save_to_disk"):
        assert open_chat(os.path.join(spec, "test")).total == len(HELD_OUT)


def test_jsonl_and_parquet_files_keep_ndjax_readers(tmp_path):
    write_chat_jsonl(tmp_path / "c.jsonl", conversations(4))
    corpus = open_chat(str(tmp_path / "c.jsonl"))
    assert isinstance(corpus, sources.Corpus) and corpus.kind == "jsonl"
    assert isinstance(open_chat(str(tmp_path / "*.jsonl")), sources.Corpus)
    # Text sources never go through datasets: a folder is still refused there.
    with pytest.raises(ConfigError, match="is a directory"):
        sources.open_corpus("jsonl", str(tmp_path), "data.files", "text")


def one_line_error(spec, match, field="data.files"):
    with pytest.raises(ConfigError, match=match) as e:
        open_chat(spec, field=field)
    assert "\n" not in str(e.value) and str(e.value).startswith(field), str(e.value)
    return str(e.value)


def test_a_hub_id_in_no_cache_says_how_to_download_it(tmp_path):
    message = one_line_error("org/missing", "hf download org/missing --repo-type dataset")
    assert "'org/missing'" in message and "run again" in message
    one_line_error("org/missing", "hf download", field="data.eval_files")


def test_bad_specs_are_one_line(tmp_path):
    folder = saved(tmp_path)
    one_line_error(os.path.join(folder, "*.json"), "metadata of a datasets save_to_disk")
    one_line_error(f"{csv_file(tmp_path)},{folder}", "mixes kinds of data")
    write_chat_jsonl(tmp_path / "c.jsonl", conversations(2))
    one_line_error(f"{tmp_path / 'c.jsonl'},{tmp_path / 'rows.csv'}", "mixes kinds of data")
    one_line_error(f"{tmp_path / 'rows.csv'},{tmp_path / 'gone.jsonl'}", "no such file")
    (tmp_path / "empty").mkdir()
    one_line_error(str(tmp_path / "empty"), "no data files")
    _dataset([{"text": "x"}]).save_to_disk(str(tmp_path / "plain"))
    one_line_error(str(tmp_path / "plain"), r"none of the columns .*data.messages_field")
    datasets.DatasetDict(a=_dataset(ROWS), b=_dataset(ROWS)).save_to_disk(str(tmp_path / "ab"))
    one_line_error(str(tmp_path / "ab"), r"splits \['a', 'b'\], none of them 'train'.*ab/a")
    (tmp_path / "broken.arrow").write_bytes(b"not arrow")
    one_line_error(str(tmp_path / "broken.arrow"), "Hugging Face datasets could not read it")


def test_a_saved_dataset_trains_like_its_jsonl(tmp_path):
    """The loader end to end: the same conversations as a save_to_disk folder and as JSON
    Lines make the same tokenized conversations; a bad record names its row."""
    chats = conversations(16)
    tok = str(write_chat_tokenizer(tmp_path / "tok", "chatml"))
    jsonl = data_config("chat", str(write_chat_jsonl(tmp_path / "c.jsonl", chats)),
                        vocab_size=384, batch_size=4, seq_len=112, tokenizer=tok)
    _dataset([{"messages": c, "id": i} for i, c in enumerate(chats)]).save_to_disk(
        str(tmp_path / "saved"))
    folder = data_config("chat", str(tmp_path / "saved"), vocab_size=384, batch_size=4,
                         seq_len=112, tokenizer=tok)
    with make_loader(jsonl, 384, prefetch=0) as a, make_loader(folder, 384, prefetch=0) as b:
        got = lambda loader: sorted(tuple(int(i) for i in c[0])  # noqa: E731
                                    for c in loader.source.convs)
        assert got(a) == got(b)
    bad = [*chats[:3], [{"role": "narrator", "content": "x"}]]
    _dataset([{"messages": c} for c in bad]).save_to_disk(str(tmp_path / "bad"))
    folder.data.files = str(tmp_path / "bad")
    with pytest.raises(ConfigError, match=rf"data.files: {tmp_path / 'bad'} row 3: "):
        make_loader(folder, 384, prefetch=0)
