"""A run's workdir is self-contained: generate, export and resume read nothing from
the directories the run started from (model.init_from, the tokenizer's)."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_config
from data_files import texts, write_jsonl, write_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ndjax.data.tokenizers import load_tokenizer
from ndjax.runs.workdir import SOURCE, TOKENIZER, run_config
from ndjax.training.loop import _keep_metrics_until, train
from ndjax.verbs import generate, plot
from ndjax.verbs.export import export_checkpoint

SCALING = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=16)


def _source(directory):
    """A transformers checkpoint whose rms_norm_eps and rope scaling are not ndjax's
    defaults: a saved config that forgot them would build another model."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-3, rope_theta=20_000.0, rope_scaling=dict(rope_type="llama3", **SCALING),
        bos_token_id=1, eos_token_id=2)).save_pretrained(directory)


def _config(init_from, steps):
    c = tiny_config(mesh=dict(fsdp=4, tensor=2), train=dict(steps=steps))
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "rope_theta"):
        c.model[field] = None
    c.model.init_from = str(init_from)
    c.data.source = "builtin"  # bytes: the run's tokenizer is the byte tokenizer
    return c


def test_generate_export_and_resume_after_the_source_is_gone(tmp_path, cpu_devices):
    source, run = tmp_path / "source", tmp_path / "run"
    _source(source)
    first = _config(source, steps=2)
    first.export.hf_dir = str(tmp_path / "hf_at_end")
    train(first, str(run), cpu_devices, verbose=False)

    saved = json.loads((run / "config.json").read_text())["model"]
    assert saved["init_from"] == str(source)  # where it started, for the record
    assert saved["rms_norm_eps"] == 1e-3 and saved["rope_theta"] == 20_000.0
    assert saved["rope_scaling"] == {**SCALING, "rope_type": "llama3"}
    assert (saved["vocab_size"], saved["dim"], saved["n_kv_heads"]) == (264, 64, 4)
    assert (run / SOURCE / "config.json").is_file()
    assert not list((run / SOURCE).glob("*.safetensors"))  # weights come from checkpoints

    shutil.move(source, tmp_path / "moved")
    assert run_config(str(run)).model.init_from is None

    model = generate.load(workdir=str(run), devices=cpu_devices)
    assert model.exp.model_cfg.rms_norm_eps == 1e-3
    assert model.exp.model_cfg.rope_scaling.factor == 4.0

    out = tmp_path / "hf"
    assert export_checkpoint(str(run), str(out), devices=cpu_devices) == 2
    exported = json.loads((out / "config.json").read_text())
    assert exported["rms_norm_eps"] == 1e-3
    assert exported["rope_scaling"]["factor"] == 4.0
    # The ids of the tokenizer the run trained with (bytes: end 256, begin 257), not the
    # source's 1 and 2, which the byte-level model never saw as such.
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (257, 256)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.rms_norm_eps == 1e-3
    # train.py's own export at the end wrote the same config.json.
    assert json.loads((tmp_path / "hf_at_end" / "config.json").read_text()) == exported

    # Resume with the very command the run started with: the model comes from the
    # workdir, the weights from its checkpoint at step 2.
    records = train(_config(source, steps=4), str(run), cpu_devices, verbose=False)
    assert [r["step"] for r in records] == [3, 4]
    assert np.isfinite([r["loss"] for r in records]).all()


def test_torn_and_bad_metrics_lines_never_block_a_resume(tmp_path):
    """A host crash or a full disk mid-write leaves a torn last line in metrics.jsonl:
    the resume's trimming and ndjax plot leave it (and any other line that is not a
    record) out with one warning, instead of a JSONDecodeError on every later resume."""
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)]
    path.write_text(good[0] + "not json\n" + "".join(good[1:]) + '[1]\n{"step": 5, "lo')
    with pytest.warns(UserWarning, match=r"left out 3 line\(s\).*line 2, 6, 7"):
        assert [r["step"] for r in plot.read_metrics(str(tmp_path))] == [1, 2, 3, 4]
    with pytest.warns(UserWarning, match="left out 3 line"):
        _keep_metrics_until(str(path), 3)
    assert path.read_text() == "".join(good[:3])  # what a resume from step 3 appends to


def test_resume_with_init_from_and_tokenizer_gone_then_changed(tmp_path, cpu_devices):
    """A run from a Hugging Face dir with a tokenizer.json: with both deleted, the same
    command resumes from the workdir's copies, and its losses are the uninterrupted
    run's; with the tokenizer file back but different, it resumes with the run's copy
    (the ids its checkpoints learned) and says so."""
    source, tok_dir, run = tmp_path / "source", tmp_path / "tok", tmp_path / "run"
    _source(source)
    tok_dir.mkdir()
    tokenizer = write_tokenizer(tok_dir / "tokenizer.json", texts(), vocab_size=264)
    original = tokenizer.read_bytes()
    files = write_jsonl(tmp_path / "train.jsonl", texts(48))

    def config(steps):
        c = _config(source, steps)
        c.data.update(source="jsonl", files=str(files), tokenizer=str(tokenizer))
        c.checkpoint.every, c.log.tensorboard = 2, False
        return c

    # Uninterrupted: 5 steps, checkpoints at 2, 4 and 5.
    reference = {r["step"]: r["loss"] for r in train(config(5), str(run), cpu_devices,
                                                     verbose=False)}
    for step in (4, 5):  # back to step 2, as if the run had been killed after it
        shutil.rmtree(run / "checkpoints" / str(step))
    shutil.rmtree(source)
    shutil.rmtree(tok_dir)
    load_tokenizer.cache_clear()  # read files afresh, as a new train.py process would
    resumed = train(config(4), str(run), cpu_devices, verbose=False)
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in resumed], [reference[3], reference[4]],
                               rtol=1e-6)

    tok_dir.mkdir()  # another tokenizer.json where the run's was
    write_tokenizer(tokenizer, ["xyzzy plugh " * 20] * 4, vocab_size=264)
    assert tokenizer.read_bytes() != original
    load_tokenizer.cache_clear()
    with pytest.warns(UserWarning, match="has changed since the run.*resuming with the run's"):
        last = train(config(5), str(run), cpu_devices, verbose=False)
    assert [r["step"] for r in last] == [5]
    np.testing.assert_allclose(last[0]["loss"], reference[5], rtol=1e-6)
    assert (run / TOKENIZER / "tokenizer.json").read_bytes() == original  # not overwritten
