"""Tokens added to a checkpoint's tokenizer (data.added_tokens, data.added_special_tokens:
Axolotl's ``tokens`` and ``special_tokens``), against transformers.

Checked: the ids equal transformers' ``add_tokens`` / ``add_special_tokens``; the grown
model's logits equal transformers' after ``resize_token_embeddings`` with the new rows
set to the mean of the old ones (float32, max abs difference <= 1e-4, as tests/test_hf.py);
training moves the new rows; the export loads in transformers with the grown vocabulary,
the same weights and the same tokenization; LoRA and the byte tokenizer refuse additions.
Not checked: transformers' random spread around the mean (``mean_resizing=True``), which
ndjax leaves out on purpose.
"""

import copy
import json

import jax
import numpy as np
import pytest
import torch
from data_files import data_config, texts, write_jsonl, write_text, write_tokenizer
from safetensors import safe_open
from test_hf import config_for, exported_run, hf_logits, make_hf, ndjax_logits
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer

from ndjax.data.loader import data_tokenizer
from ndjax.data.tokenizers import Additions, HFTokenizer
from ndjax.experiment import Experiment
from ndjax.runs import hf
from ndjax.runtime.errors import ConfigError
from ndjax.training.loop import train
from ndjax.verbs import from_axolotl
from ndjax.verbs.export import export_checkpoint

NEW = ("<tool_call>", "[[fact]]")
NEW_SPECIAL = ("<|im_start|>", "<|im_end|>")
TEXT = "alpha <tool_call> beta [[fact]] gamma <|im_start|> delta <|im_end|>"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random Llama whose vocabulary is exactly its tokenizer's (300 ids), so that
    every added token grows it; the tokenizer.json beside it."""
    folder = tmp_path_factory.mktemp("source")
    path = write_tokenizer(folder / "tokenizer.json", texts(24))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "pad_token": "<pad>"}))
    model = make_hf(folder, vocab_size=300)
    return folder, path, model


def reference_tokenizer(folder):
    ref = AutoTokenizer.from_pretrained(folder)
    ref.add_special_tokens({"additional_special_tokens": list(NEW_SPECIAL)})
    ref.add_tokens([AddedToken(t, normalized=False) for t in NEW])
    return ref


def with_added(c, path, text_dir=None):
    c.data.tokenizer = str(path)
    c.data.added_tokens = NEW
    c.data.added_special_tokens = NEW_SPECIAL
    if text_dir is not None:
        c.data.source, c.data.files = "text", str(text_dir / "*.txt")
    return c


def test_ids_equal_transformers(source):
    folder, path, _ = source
    tok = HFTokenizer(str(path), added=Additions(NEW, NEW_SPECIAL))
    ref = reference_tokenizer(folder)
    assert (tok.file_vocab_size, tok.vocab_size, len(ref)) == (300, 304, 304)
    assert tok.encode(TEXT) == ref(TEXT, add_special_tokens=False).input_ids
    assert set(NEW_SPECIAL) <= set(tok.special_tokens)


@pytest.mark.parametrize("mesh", ["one_device", "fsdp_tp"])
def test_grown_model_equals_transformers_resized_to_the_mean(source, mesh):
    """On fsdp x tensor a shard of the vocabulary straddles the files' last row."""
    folder, path, model = source
    layout = dict(fsdp=4, tensor=2) if mesh == "fsdp_tp" else None
    devices = jax.devices()[:8 if layout else 1]
    exp = Experiment.from_config(with_added(config_for(folder, layout), path), devices)
    assert exp.model_cfg.vocab_size == 304 and exp.checkpoint.file_vocab == 300
    ref = copy.deepcopy(model)  # resizing changes the model and its config in place
    ref.resize_token_embeddings(304, mean_resizing=False)
    with torch.no_grad():
        for table in (ref.model.embed_tokens.weight, ref.lm_head.weight):
            table[300:] = table[:300].mean(0)
    toks = np.random.default_rng(3).integers(0, 304, (4, 32)).astype(np.int32)
    toks[:, :4] = [300, 301, 302, 303]  # every new id, in every row
    params = hf.load_params(exp.checkpoint, exp.param_shapes, exp.state_sharding.params)
    np.testing.assert_allclose(ndjax_logits(exp, params, toks), hf_logits(ref, toks), atol=1e-4)


def test_new_rows_train_and_export_to_transformers(source, tmp_path):
    folder, path, _ = source
    write_text(tmp_path / "txt", [f"{t} {TEXT}" for t in texts(24)])
    c = with_added(config_for(folder), path, tmp_path / "txt")
    c.train.steps, c.train.batch_size, c.train.seq_len = 2, 4, 32
    c.log.tensorboard = False
    c.checkpoint.async_save = False
    one = jax.devices()[:1]
    train(c, str(tmp_path / "w"), devices=one, verbose=False)
    out = tmp_path / "out"
    export_checkpoint(str(tmp_path / "w"), str(out), dtype="float32", devices=one)

    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 304
    with safe_open(out / "model.safetensors", "np") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    mean = embed[:300].mean(0)
    assert embed.shape == (304, 64)
    # Each new row started at the mean of the file's rows and was trained away from it
    # (the data holds every new token; the old rows moved too, so compare the distance).
    assert all(np.abs(embed[i] - mean).max() > 1e-4 for i in range(300, 304))

    exported = AutoTokenizer.from_pretrained(out)
    tok = data_tokenizer(c.data)
    assert exported(TEXT, add_special_tokens=False).input_ids == tok.encode(TEXT)
    assert exported(TEXT, add_special_tokens=False).input_ids == \
        reference_tokenizer(folder)(TEXT, add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.get_input_embeddings().weight.shape == (304, 64)
    np.testing.assert_array_equal(model.get_input_embeddings().weight.detach().numpy(), embed)


def test_named_tokens_reach_the_export(source, tmp_path):
    """data.pad_token names an added special token: tokenizer_config.json says so."""
    folder, path, _ = source
    out = exported_run(tmp_path, str(path), added_special_tokens=("<|pad|>",),
                       pad_token="<|pad|>")
    exported = AutoTokenizer.from_pretrained(out)
    assert exported.pad_token == "<|pad|>" and exported.pad_token_id == 300
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 300


def test_refusals(source):
    folder, path, _ = source
    c = with_added(config_for(folder), path)
    c.model.lora.rank = 4
    with pytest.raises(ConfigError, match=r"give 4 new token id\(s\) .* model.lora.rank=4 "
                                          r"trains adapters only: set model.lora."
                                          r"modules_to_save='embed_tokens,lm_head'"):
        Experiment.from_config(c, jax.devices()[:1])
    c = data_config("text", "x.txt")
    c.data.added_tokens = ("<a>",)
    with pytest.raises(ConfigError, match=r"the byte tokenizer takes none"):
        data_tokenizer(c.data)
    with pytest.raises(ConfigError, match=r"data.added_tokens=\('', 'b'\): every token must "
                                          r"be a non-empty string"):
        HFTokenizer(str(path), added=Additions(("", "b")))
    with pytest.raises(ConfigError, match=r"data.pad_token='<nope>' is not a token of "
                                          r".*add it with data.added_special_tokens"):
        HFTokenizer(str(path), pad_token="<nope>")


def test_axolotl_tokens_and_special_tokens_convert(source, tmp_path):
    """Axolotl's tokens and special_tokens become the data fields above; the converted
    config grows the model; with LoRA the converter's check refuses, naming the Axolotl
    fields; a bad value is a problem naming its field."""
    folder, _, _ = source
    write_jsonl(tmp_path / "text.jsonl", texts(8))
    raw = dict(base_model=str(folder), datasets=[dict(path=str(tmp_path / "text.jsonl"),
                                                      type="completion")],
               sequence_len=32, micro_batch_size=1, gradient_accumulation_steps=1, max_steps=2,
               learning_rate=1e-4, output_dir=str(tmp_path / "out"), tokens=list(NEW),
               special_tokens=dict(pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   unk_token="<unk>"))
    conv = from_axolotl.convert(raw, devices=1)
    assert {k: v for k, v in conv.overrides.items() if "token" in k} == {
        "data.tokenizer": str(folder / "tokenizer.json"), "data.added_tokens": NEW,
        "data.added_special_tokens": ("<|pad|>", "<|endoftext|>"),
        "data.pad_token": "<|pad|>", "data.eos_token": "<|endoftext|>"}
    assert [u.field for u in conv.unmapped] == ["special_tokens.unk_token"]
    text = from_axolotl.render(conv, "config.yml")
    from_axolotl.check(text, conv)
    exp = Experiment.from_config(from_axolotl.load(text), jax.devices()[:1])
    assert exp.model_cfg.vocab_size == 303  # <|pad|> and the two tokens are new

    conv = from_axolotl.convert({**raw, "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
                                 "lora_target_linear": True}, devices=1)
    with pytest.raises(ConfigError, match=r"give 3 new token id\(s\).*\(data.added_tokens "
                                          r"from tokens; data.added_special_tokens from "
                                          r"special_tokens"):
        from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)
    # As Axolotl asks: lora_modules_to_save trains them beside the adapters.
    conv = from_axolotl.convert({**raw, "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
                                 "lora_target_linear": True, "lora_modules_to_save": [
                                     "embed_tokens", "lm_head", "norm"]}, devices=1)
    assert conv.overrides["model.lora.modules_to_save"] == "embed_tokens,lm_head"
    assert "lora_modules_to_save" in [u.field for u in conv.unmapped]  # norm is not taken
    from_axolotl.check(from_axolotl.render(conv, "config.yml"), conv)
    with pytest.raises(from_axolotl.ConversionError) as e:
        from_axolotl.convert({**raw, "tokens": 5, "special_tokens": {"pad_token": ""}},
                             devices=1)
    assert e.value.conversion.problems == [
        "tokens: 5 must be a list of token strings, e.g. tokens: ['<tool_call>', "
        "'</tool_call>'].", "special_tokens.pad_token: '' must be a non-empty string."]


def test_lora_trains_new_rows_beside_the_adapters_and_peft_loads_them(source, tmp_path):
    """model.lora.modules_to_save: the embedding and LM head train in full beside the
    adapters (new rows included) and go into the adapter directory under PEFT's names;
    PEFT on the base resized as transformers resizes it gives the logits of ndjax's
    merged export (float32, 1e-4)."""
    folder, path, _ = source
    write_text(tmp_path / "txt", [f"{t} {TEXT}" for t in texts(24)])
    c = with_added(config_for(folder, hf_dir=str(tmp_path / "merged"),
                              adapter_dir=str(tmp_path / "adapter"), dtype="float32"),
                   path, tmp_path / "txt")
    c.model.lora.update(rank=4, alpha=8.0, modules_to_save="embed_tokens,lm_head")
    c.model.param_dtype = "float32"  # the base as PEFT loads it (LoRA's default: bfloat16)
    c.train.steps, c.train.batch_size, c.train.seq_len = 2, 4, 32
    c.log.tensorboard = False
    train(c, str(tmp_path / "w"), devices=jax.devices()[:1], verbose=False)

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"]
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "np") as f:
        embed = f.get_tensor("base_model.model.model.embed_tokens.weight")
        head = f.get_tensor("base_model.model.lm_head.weight")
    assert embed.shape == head.shape == (304, 64)
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    start = base.get_input_embeddings().weight.detach().numpy()
    assert np.abs(embed[:300] - start).max() > 1e-4  # the old rows trained too
    assert all(np.abs(embed[i] - start.mean(0)).max() > 1e-4 for i in range(300, 304))

    from peft import PeftModel
    base.resize_token_embeddings(304, mean_resizing=False)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    toks = np.random.default_rng(4).integers(0, 304, (4, 32)).astype(np.int32)
    toks[:, :4] = [300, 301, 302, 303]
    np.testing.assert_allclose(hf_logits(peft, toks), hf_logits(merged, toks), atol=1e-4)

    # Going on from that adapter (model.lora.init_from, as DPO after SFT does): step 0
    # holds its adapters and its embedding and LM head, PEFT's logits.
    c.model.lora.init_from = str(tmp_path / "adapter")
    c.export.update(hf_dir=None, adapter_dir=None)
    exp = Experiment.from_config(c, jax.devices()[:1])
    np.testing.assert_allclose(ndjax_logits(exp, exp.init_state().params, toks),
                               hf_logits(peft, toks), atol=1e-4)
    c.model.lora.modules_to_save = "embed_tokens"
    with pytest.raises(ConfigError, match=r"adapter_config.json has modules_to_save="
                                          r"\['embed_tokens', 'lm_head'\], and model.lora."
                                          r"modules_to_save='embed_tokens': set"):
        Experiment.from_config(c, jax.devices()[:1])


def test_lora_modules_to_save_on_fsdp_tensor_and_across_a_resume(source, tmp_path):
    """The embedding and LM head trained beside the adapters: 3 steps on fsdp x tensor
    equal one device's (losses rtol 1e-5, as tests/test_layouts.py), and so do 2 steps
    then a resume to 3 (the checkpoint holds them with the adapters)."""
    folder, path, _ = source
    write_text(tmp_path / "txt", [f"{t} {TEXT}" for t in texts(24)])
    losses = {}
    for name, layout, steps in (("one", None, (3,)), ("fsdp_tp", dict(fsdp=4, tensor=2), (3,)),
                                ("resumed", None, (2, 3))):
        for n in steps:
            c = with_added(config_for(folder, layout), path, tmp_path / "txt")
            c.model.lora.update(rank=4, alpha=8.0, modules_to_save="embed_tokens,lm_head")
            c.train.update(steps=n, batch_size=8, seq_len=32)
            c.log.tensorboard = False
            c.checkpoint.async_save = False
            devices = jax.devices()[:8 if layout else 1]
            records = train(c, str(tmp_path / name), devices=devices, verbose=False)
            losses.setdefault(name, []).extend(r["loss"] for r in records if "loss" in r)
    assert len(losses["one"]) == 3 and losses["one"][-1] < losses["one"][0]
    np.testing.assert_allclose(losses["fsdp_tp"], losses["one"], rtol=1e-5)
    np.testing.assert_allclose(losses["resumed"], losses["one"], rtol=1e-5)
