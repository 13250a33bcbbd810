"""Context parallelism trains exactly like one device, in-process and through train.py.

Tolerances as in test_layouts (losses of 3 AdamW steps at rtol 1e-5, first-step
gradients; f32): ring attention changes only the order of float32 sums (its
online softmax, the permuted token order of the loss), like any layout does.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_config
from data_files import chat_overrides
from helpers import (
    assert_same_training,
    host_batches,
    reference,
    train_py_flags,
    with_overrides,
)
from test_train_cli import ROOT, losses

from ndjax.experiment import Experiment
from ndjax.ops import ring_attention as ra
from ndjax.runtime.errors import ConfigError

LAYOUTS = {
    # FSDP x context, balanced: the configs/llama_fsdp_cp.py mesh.
    "fsdp_cp_zigzag": (dict(fsdp=4, context=2), {}),
    # The same on chat data: whole conversations per row, padding (segment 0) at the
    # end of rows, the loss on the replies only; the zigzag order scatters all of it.
    "fsdp_cp_zigzag_chat": (dict(fsdp=4, context=2), "chat"),
    # Context with tensor parallelism and replicas, unbalanced layout, and key
    # tiles shorter than a block (16 tokens per shard, tiles of 4).
    "replica_cp_tp_contiguous": (dict(replica=2, context=2, tensor=2),
                                 dict(cp_layout="contiguous", attn_kv_tile=4)),
    # All-to-all: FSDP x context, the kernel over the whole sequence (dense at 32
    # tokens) on half of each device's 8 heads.
    "fsdp_cp_all_to_all": (dict(fsdp=4, context=2), dict(cp_impl="all_to_all")),
    # Context x tensor: 4 query and 2 kv heads a device, 4 context shards, so each
    # kv head is repeated twice for every slice to hold one; tiled's online softmax
    # (its custom VJP) inside.
    "cp_tp_all_to_all_tiled": (dict(context=4, tensor=2),
                               dict(cp_impl="all_to_all", attn_impl="tiled", attn_kv_tile=4)),
    # Every model axis at once, on chat rows (documents and padding), blocked inside.
    "fsdp_cp_tp_all_to_all_chat": (dict(fsdp=2, context=2, tensor=2),
                                   ("chat", dict(cp_impl="all_to_all", attn_impl="blocked"))),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_layout_matches_single_device(layout, tmp_path_factory):
    mesh, model = LAYOUTS[layout]
    overrides = None
    if model == "chat" or isinstance(model, tuple):
        model = {} if model == "chat" else model[1]
        overrides = chat_overrides(tmp_path_factory.mktemp("chat"))
    exp = Experiment.from_config(with_overrides(tiny_config(mesh=mesh, model=model), overrides))
    hlo = exp.compiled_step.as_text()
    if model.get("cp_impl") == "all_to_all":
        assert exp.model_cfg.cp_impl == "all_to_all", exp.attention
        assert exp.model_cfg.attn_impl == model.get("attn_impl", "dense"), exp.attention
        assert exp.seq_permutation is None  # the natural order: no zigzag
        # Sequence shards became head shards and back, and no block went round a ring.
        assert "all-to-all" in hlo and "collective-permute" not in hlo
    else:
        assert exp.model_cfg.attn_impl == "ring", exp.attention
        # The step really ran the ring: its key/value blocks moved between devices.
        assert "collective-permute" in hlo
    # The single-device reference runs dense attention on the unpermuted batch.
    assert_same_training(exp, model, overrides)


def _choice(mesh, **model):
    return Experiment.from_config(tiny_config(mesh=mesh, model=model)).attention


def test_cp_impl_auto_says_why_and_all_to_all_checks_the_heads():
    # On CPU, auto keeps the ring: all_to_all would run the same tiles, moving q and
    # the output as well as k and v.
    ring = _choice(dict(fsdp=4, context=2))
    assert (ring.name, ring.cp) == ("ring", "ring") and "no fused kernel" in ring.why
    # A one-shard kernel asked for by name runs inside all_to_all.
    tiled = _choice(dict(fsdp=4, context=2), attn_impl="tiled")
    assert (tiled.name, tiled.cp, tiled.label) == ("tiled", "all_to_all", "all_to_all+tiled")
    # 2 heads a device cannot split over 4 context shards: all_to_all is refused in one
    # line naming the fields; auto says why it took the ring instead.
    few = dict(n_heads=2, n_kv_heads=1)
    with pytest.raises(ConfigError, match=r"model.cp_impl='all_to_all' .* each device holds 2 "
                                          r"\(model.n_heads=2 over 1 tensor shards\)"):
        _choice(dict(fsdp=2, context=4), cp_impl="all_to_all", **few)
    fallback = _choice(dict(fsdp=2, context=4), **few)
    assert fallback.name == "ring" and "all_to_all refused" in fallback.why
    with pytest.raises(ConfigError, match="model.attn_impl='ring' is the ring algorithm"):
        _choice(dict(fsdp=4, context=2), cp_impl="all_to_all", attn_impl="ring")
    with pytest.raises(ConfigError, match="runs on one context shard.*cp_impl='all_to_all'"):
        _choice(dict(fsdp=4, context=2), cp_impl="ring", attn_impl="tiled")


def test_zigzag_batch_is_permuted_on_the_host():
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, context=2)))
    perm = ra.zigzag_permutation(32, 2)
    np.testing.assert_array_equal(exp.seq_permutation, perm)
    host = host_batches(exp.config, 1)[0]
    device = exp.device_batch(host)
    for name, array in device.items():  # every field alike, so targets stay aligned
        np.testing.assert_array_equal(np.asarray(array), host[name][:, perm], err_msg=name)
    # Shard 1 of the context axis holds chunks 1 and 2 of the 4 (tokens 8-23).
    shard = [s for s in device["positions"].addressable_shards if s.index[1].start == 16][0]
    np.testing.assert_array_equal(np.asarray(shard.data), host["positions"][shard.index[0], 8:24])
    contiguous = tiny_config(mesh=dict(fsdp=4, context=2), model=dict(cp_layout="contiguous"))
    assert Experiment.from_config(contiguous).seq_permutation is None
    assert Experiment.from_config(tiny_config(mesh=dict(fsdp=8))).seq_permutation is None


# The tiny_config experiment as train.py flags, so that train.py's losses can be
# compared with the in-process single-device reference.
TINY_CONFIG_FLAGS = train_py_flags()


def start_train(config, workdir, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={config}",
           f"--workdir={workdir}", *TINY_CONFIG_FLAGS, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_train_py_context_configs_log_single_device_losses(tmp_path):
    # Both runs start at once; the single-device reference runs here meanwhile.
    runs = {"configs/llama_fsdp_cp.py": start_train("configs/llama_fsdp_cp.py", tmp_path / "cp"),
            # 16 devices: more than this test process has, hence a subprocess.
            "configs/llama_4d.py": start_train("configs/llama_4d.py", tmp_path / "4d"),
            # The same 4D layout with all-to-all context parallelism.
            "configs/llama_4d.py all_to_all": start_train(
                "configs/llama_4d.py", tmp_path / "4d_a2a", "--config.model.cp_impl=all_to_all")}
    _, ref_losses, _ = reference({})
    for (config, proc), workdir in zip(runs.items(), ("cp", "4d", "4d_a2a")):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{config}: {stderr[-3000:]}"
        algorithm = "all_to_all (" if config.endswith("all_to_all") else "ring ("
        assert f"attention: {algorithm}" in stdout, (config, stdout[-3000:])
        np.testing.assert_allclose(losses(tmp_path / workdir), ref_losses, rtol=1e-5,
                                   err_msg=config)
    config = (tmp_path / "4d" / "config.json").read_text()
    assert '"context": 2' in config and '"cpu_devices": 16' in config
