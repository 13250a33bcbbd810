"""Generation (ndjax generate, ndjax.models.sampling) against transformers' generate.

Greedy decoding of a random tiny Llama must give transformers' tokens exactly:
both sides compute in float32 and differ by ~1e-6 in the logits (test_hf.py),
far below the gaps between the top two logits of a model whose logits spread
over ~1. Each prompt is generated alone (no padding) by transformers and in one
left-padded batch by ndjax, so positions and masks of padded rows are checked.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from conftest import tiny_config
from test_hf import CASES, make_hf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ndjax.models.sampling import Sampling, sample
from ndjax.runtime.errors import ConfigError
from ndjax.training.loop import train
from ndjax.verbs.generate import load, read_prompts, render_chat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_NEW = 10
LENGTHS = (5, 11, 3, 17)  # one batch, left-padded to 32 slots
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(directory, chat=True):
    """A small BPE tokenizer.json (BOS <s> = 1 added by its post-processor, EOS </s> = 2,
    as transformers' LlamaConfig defaults) and a tokenizer_config.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog",
                             "hello world, how are you today?"] * 10,
                            trainers.BpeTrainer(vocab_size=200,
                                                special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    config = dict(bos_token="<s>", eos_token="</s>")
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Case -> (directory, float32 torch model) with a tokenizer, built once."""
    out = {}
    for case in ("gqa_llama3", "mqa_tied"):
        directory = tmp_path_factory.mktemp(case)
        out[case] = (directory, make_hf(directory, **CASES[case]))
        write_tokenizer(directory)
    return out


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in LENGTHS]


def hf_greedy(model, ids, n=N_NEW, eos=2):
    """transformers' greedy tokens for each prompt alone, EOS included when it stops."""
    out = []
    for p in ids:
        with torch.no_grad():
            full = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n,
                                  eos_token_id=eos, pad_token_id=eos)
        out.append(full[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("case, mesh", [("gqa_llama3", None),
                                        ("gqa_llama3", dict(fsdp=4, tensor=2)),
                                        # one kv head on tensor=2: replicated, as in training
                                        ("mqa_tied", dict(fsdp=2, tensor=2))])
def test_greedy_matches_transformers(hf_dirs, case, mesh):
    directory, model = hf_dirs[case]
    if mesh is None:
        m = load(hf_dir=str(directory), devices=jax.devices()[:1])
    else:
        overrides = {f"mesh.{k}": v for k, v in mesh.items()}
        m = load(hf_dir=str(directory), overrides=overrides,
                 devices=jax.devices()[:mesh["fsdp"] * mesh["tensor"]])
    ids = prompts()
    ref = hf_greedy(model, ids)
    assert m.eos_ids == (2,)  # generation_config.json
    assert m.generator(N_NEW)(ids) == ref
    if mesh is None or case != "gqa_llama3":
        return
    # An EOS that the first prompt meets after 4 tokens: that row stops there, the
    # others run on (or stop at their own), as transformers' do.
    eos = ref[0][3]
    stopped = dataclasses.replace(m, eos_ids=(eos,)).generator(N_NEW)(ids)
    assert stopped == hf_greedy(model, ids, eos=eos) and len(stopped[0]) == 4


def test_cache_layout_follows_the_rules(hf_dirs):
    directory, _ = hf_dirs["gqa_llama3"]
    m = load(hf_dir=str(directory), overrides={"mesh.fsdp": 4, "mesh.tensor": 2})
    g = m.generator(N_NEW)
    assert g.shapes(3, 17) == (4, 32) and g.shapes(5, 9) == (8, 16) and g.shapes(1, 2) == (4, 8)
    from ndjax.parallel import rules as rules_lib
    with rules_lib.use(g.rules):
        tokens, pad = g.inputs(prompts())
        _, cache = g.prefill(g.params, tokens, pad, g.key)
    # (layers, rows, slots, kv heads, head_dim): rows over fsdp, kv heads over tensor.
    assert cache.k.shape == (2, 4, 32 + N_NEW, 2, 8)
    assert cache.k.sharding.spec == jax.P(None, "fsdp", None, "tensor")
    assert np.asarray(pad).tolist() == [32 - n for n in LENGTHS]


def test_sampling_is_seeded(hf_dirs):
    directory, _ = hf_dirs["gqa_llama3"]
    m = load(hf_dir=str(directory), devices=jax.devices()[:1])
    s = Sampling(temperature=1.0, top_p=0.9, top_k=40)
    ids = prompts()
    first, again = m.generator(N_NEW, s, seed=0)(ids), m.generator(N_NEW, s, seed=0)(ids)
    other = m.generator(N_NEW, s, seed=1)(ids)
    assert first == again and first != other
    assert first != m.generator(N_NEW)(ids)  # not greedy


def test_each_prompt_draws_its_own_randomness(hf_dirs):
    """16 copies of one prompt, 8 per batch: the second batch does not replay the first's
    draws (every completion is its own), a seed repeats the whole output in a new
    generator, and a prompt's draws do not depend on the batch it falls in."""
    directory, _ = hf_dirs["gqa_llama3"]
    m = load(hf_dir=str(directory), devices=jax.devices()[:1])
    s = Sampling(temperature=1.0)
    ids = [prompts()[0]] * 16
    out = m.generator(N_NEW, s, seed=0)(ids, batch_size=8)
    repeats = [i for i in range(8) if out[i] == out[i + 8]]
    assert not repeats, f"completions {repeats} equal those 8 prompts later"
    assert len({tuple(c) for c in out}) == 16
    assert m.generator(N_NEW, s, seed=0)(ids, batch_size=8) == out
    assert m.generator(N_NEW, s, seed=0)(ids, batch_size=16) == out


def test_top_k_and_top_p_cut_the_distribution():
    keys = jax.random.split(jax.random.key(0), 4)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 512, np.float32))
    seen = {name: set() for name in ("k", "p", "all")}
    for key in keys:
        seen["k"] |= set(np.asarray(sample(logits, key, Sampling(1.0, top_k=2))).tolist())
        seen["p"] |= set(np.asarray(sample(logits, key, Sampling(1.0, top_p=0.7))).tolist())
        seen["all"] |= set(np.asarray(sample(logits, key, Sampling(1.0))).tolist())
    assert seen == {"k": {0, 1}, "p": {0, 1}, "all": {0, 1, 2, 3}}
    assert np.asarray(sample(logits, keys[0], Sampling(0.0))).tolist() == [0] * 512


def test_chat_template_renders_as_transformers(hf_dirs):
    from transformers import AutoTokenizer
    directory, _ = hf_dirs["gqa_llama3"]
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        [{"role": "user", "content": "hello fox"}], add_generation_prompt=True, tokenize=False)
    assert render_chat(str(directory), "test", ["hello fox"]) == [expected]
    m = load(hf_dir=str(directory), devices=jax.devices()[:1])
    chat, plain = m.encode(["hello fox"], chat=True)[0], m.encode(["hello fox"])[0]
    assert chat[0] == 1 and plain[0] == 1 and len(chat) > len(plain)  # one BOS each


def test_chat_uses_the_runs_template(workdir, hf_dirs, tmp_path):
    """A run trained with data.chat_template (a file) is prompted with that template, as
    its training data was rendered, not with its tokenizer's own; a template file gone
    since training is one error naming the override that points at a copy."""
    directory, _ = hf_dirs["gqa_llama3"]  # its tokenizer's 200 ids fit the tiny model
    template = tmp_path / "custom.jinja"
    # Only characters of the test tokenizer's alphabet, so no token is <unk>.
    template.write_text("{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}, "
                        "{% endfor %}{% if add_generation_prompt %}the reply {% endif %}")
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    config = json.loads((run / "config.json").read_text())
    config["data"].update(source="chat", tokenizer=str(directory / "tokenizer.json"),
                          chat_template=str(template), files="chats/train*.jsonl")
    (run / "config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    custom = tok.encode("user says hello fox, the reply ", add_special_tokens=False).ids
    own = tok.encode("<s><|user|>hello fox<|assistant|>", add_special_tokens=False).ids
    assert 0 not in custom and custom != own  # no <unk>: the renderings differ visibly
    m = load(workdir=str(run), devices=jax.devices()[:1])
    assert m.encode(["hello fox"], chat=True) == [custom]
    moved = tmp_path / "moved.jinja"
    template.rename(moved)
    with pytest.raises(ConfigError, match=r"--chat: the run's data.chat_template=.*custom.jinja"
                                          r".* --config.data.chat_template="):
        m.encode(["hello fox"], chat=True)
    m = load(workdir=str(run), overrides={"data.chat_template": str(moved)},
             devices=jax.devices()[:1])
    assert m.encode(["hello fox"], chat=True) == [custom]


def run_generate(*args):
    return subprocess.run([sys.executable, "-m", "ndjax", "generate", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT},
                          timeout=300)


def test_help_is_short():
    """--help lists every flag in a screenful; --config is a line or two, not the ~80
    lines of the default config it would otherwise print as its default."""
    result = run_generate("--help")
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    out = result.stdout
    assert len(out.splitlines()) < 60, out
    for name in ("workdir", "hf_dir", "step", "prompt", "prompts_file", "[no]chat",
                 "max_new_tokens", "max_len", "temperature", "top_p", "top_k", "seed",
                 "batch_size", "[no]json", "config"):
        assert f"\n  --{name}: " in out, (name, out)
    config_help = out.split("\n  --config: ")[1].split("\n  --")[0]
    assert len(config_help.splitlines()) <= 3 and "checkpoint:" not in out, config_help


def test_cli_from_hf_dir(hf_dirs, tmp_path):
    directory, model = hf_dirs["gqa_llama3"]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "the lazy dog"}) + "\n\n")
    result = run_generate(f"--hf_dir={directory}", "--prompt=hello world", "--json",
                          f"--prompts_file={tmp_path / 'p.jsonl'}", f"--max_new_tokens={N_NEW}",
                          "--config.runtime.cpu_devices=4", "--config.mesh.tensor=2")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    texts = ["hello world", "the lazy dog"]
    assert [r["prompt"] for r in records] == texts
    ids = [tok.encode(t).ids for t in texts]  # with BOS, as transformers tokenizes
    ref = hf_greedy(model, ids)
    for r, p, new in zip(records, ids, ref):
        assert r["prompt_tokens"] == len(p) and r["completion_tokens"] == len(new)
        assert r["completion"] == tok.decode([t for t in new if t != 2],
                                             skip_special_tokens=False)


def assert_one_line_error(result, message):
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr[-2000:]
    assert result.stderr.startswith("ndjax generate: error:") and message in result.stderr, \
        result.stderr[-2000:]


def test_cli_errors_are_one_line(hf_dirs):
    directory, _ = hf_dirs["gqa_llama3"]
    assert_one_line_error(run_generate("--prompt=hi"), "give exactly one of --workdir")
    assert_one_line_error(run_generate(f"--hf_dir={directory}", "--config.mesh.tensr=2"),
                          'bad --config override: \'tensr\' Did you mean "tensor"')
    result = run_generate(f"--hf_dir={directory}", "--prompt=" + "the quick brown fox " * 10,
                          "--max_len=32", "--max_new_tokens=8", "--config.runtime.cpu_devices=1")
    assert_one_line_error(result, "prompt 1 has 4")  # 40-odd tokens
    assert "more than --max_len=32 (--max_len)" in result.stderr


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """2 steps of the tiny model on one device, checkpointed at the end."""
    path = tmp_path_factory.mktemp("run")
    train(tiny_config(train=dict(steps=2)), str(path), devices=jax.devices()[:1], verbose=False)
    return path


def test_from_workdir_on_any_mesh(workdir):
    one = load(workdir=str(workdir), devices=jax.devices()[:1])
    assert one.max_len == 32 and one.eos_ids == (256,)  # train.seq_len, the byte EOS
    ids = one.encode(["def f(", "import numpy as np"])
    assert ids[0] == list(b"def f(")  # bytes, no BOS: as the run trained
    greedy = one.generator(8)(ids)
    sharded = load(workdir=str(workdir), overrides={"mesh.fsdp": 4, "mesh.tensor": 2})
    assert sharded.exp.mesh.shape["tensor"] == 2
    assert sharded.generator(8)(ids) == greedy
    result = run_generate(f"--workdir={workdir}", "--prompt=def f(", "--max_new_tokens=8",
                          "--config.runtime.cpu_devices=1", "--step=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == f"--- prompt 1 of 1 (6 tokens) -> 8 new tokens ---\n" \
                            f"{one.decode(greedy[0])}\n"


def test_bad_input(workdir, hf_dirs, tmp_path):
    directory, _ = hf_dirs["gqa_llama3"]
    with pytest.raises(ConfigError, match="give exactly one of --workdir"):
        load(workdir=str(workdir), hf_dir=str(directory))
    empty = tmp_path / "w"
    empty.mkdir()
    shutil.copy(workdir / "config.json", empty)
    with pytest.raises(ConfigError, match="has no checkpoints; train.py saves one"):
        load(workdir=str(empty), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"--step=5: no complete checkpoint .* \[2\]"):
        load(workdir=str(workdir), step=5, devices=jax.devices()[:1])
    m = load(workdir=str(workdir), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"--chat: the tokenizer \(byte\) has no chat template"):
        m.encode(["hi"], chat=True)
    with pytest.raises(ConfigError, match="prompt 2 is empty"):
        m.generator(4)(m.encode(["a", ""]))
    with pytest.raises(ConfigError, match=r"prompt 1 has 30 tokens; with --max_new_tokens=4 "
                                          r"that is 34, more than --max_len=32 \(the run's "
                                          r"train.seq_len\)"):
        m.generator(4)(m.encode(["x" * 30]))
    for sampling, match in ((Sampling(-1.0), "--temperature=-1.0"),
                            (Sampling(1.0, top_p=0.0), "--top_p=0.0"),
                            (Sampling(1.0, top_k=-2), "--top_k=-2")):
        with pytest.raises(ConfigError, match=match):
            m.generator(4, sampling)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:2: not a JSON object with a string 'prompt'"):
        read_prompts([], str(bad))
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompts([], None)


def test_interrupted_save_is_one_line_and_left_alone(workdir, tmp_path):
    """A workdir whose only checkpoint is an interrupted (or still running) save: one
    line, exit 2, nothing after it, and the save's temporary directory untouched (the
    run writing it may still be going)."""
    run = tmp_path / "run"
    saving = run / "checkpoints" / "5.orbax-checkpoint-tmp-1"
    saving.mkdir(parents=True)
    shutil.copy(workdir / "config.json", run)
    result = run_generate(f"--workdir={run}", "--prompt=hi", "--config.runtime.cpu_devices=1")
    assert_one_line_error(result, f"--workdir='{run}': no complete checkpoint in ")
    assert saving.is_dir()
