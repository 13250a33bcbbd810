"""Checkpoints: exact resume, resharding, preemption, safety, pruning."""

import concurrent.futures
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import host_batches, train_py_flags

from ndjax.experiment import Experiment
from ndjax.runs.checkpoint import Checkpointer
from ndjax.runtime.errors import ConfigError
from ndjax.training.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FLAGS = [*train_py_flags(), "--config.log.tensorboard=False"]


def start(workdir, *args):
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/llama_fsdp.py",
         f"--workdir={workdir}", *TINY_FLAGS, *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged_steps(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_for_step(proc, workdir, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r["step"] >= step for r in logged_steps(workdir)):
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def losses_by_step(records):
    return {r["step"]: r["loss"] for r in records}


def assert_resumed_like_uninterrupted(workdir, reference_dir, steps):
    """``workdir``'s metrics hold steps 1..``steps`` (resumed part way) with the losses
    of a run never interrupted, trained in-process on the subprocesses' mesh."""
    config = tiny_config(mesh=dict(fsdp=8), train=dict(steps=steps))
    config.log.tensorboard = False
    reference = losses_by_step(train(config, str(reference_dir), verbose=False))
    resumed = losses_by_step(logged_steps(workdir))
    assert sorted(resumed) == list(range(1, steps + 1))
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                               [reference[s] for s in sorted(resumed)], rtol=1e-6)


def test_kill_9_and_resume_is_bitwise_exact(tmp_path):
    steps = 10
    config = tiny_config(mesh=dict(fsdp=8), train=dict(steps=steps))
    config.log.tensorboard = False
    reference = losses_by_step(train(config, str(tmp_path / "ref"), verbose=False))

    workdir = str(tmp_path / "killed")
    proc = start(workdir, f"--config.train.steps={steps}", "--config.checkpoint.every=2")
    wait_for_step(proc, workdir, random.Random(0).randint(3, 7))
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait()
    saved = Checkpointer(workdir, tiny_config().checkpoint).steps()
    assert saved and max(saved) < steps

    again = start(workdir, f"--config.train.steps={steps}", "--config.checkpoint.every=2")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    assert f"resumed from checkpoint step {max(saved)}" in out
    resumed = losses_by_step(logged_steps(workdir))
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in range(max(saved) + 1, steps + 1):
        assert resumed[step] == reference[step], step  # bitwise: same mesh, same program


MOE = dict(family="qwen3_moe", head_dim=16, n_experts=4, experts_per_token=2, moe_ffn_dim=32)
DENSE = (dict(fsdp=8), {})
EXPERTS = (dict(fsdp=2, expert=4), MOE)  # the experts split 4 ways


@pytest.mark.parametrize("source, mesh, devices", [
    (DENSE, dict(replica=2, fsdp=2, tensor=2), 8),
    (DENSE, dict(fsdp=4), 4),
    (EXPERTS, dict(fsdp=2, expert=2, tensor=2), 8),
], ids=["hsdp_tp", "fewer_devices", "moe_expert2_tensor2"])
def test_restore_onto_another_layout(tmp_path_factory, source, mesh, devices):
    """Saved on one layout, resumed on another (a mixture of experts onto another
    expert degree too): the steps after the checkpoint are the uninterrupted run's."""
    saved_mesh, model = source
    base = tmp_path_factory.getbasetemp() / f"reshard_source_{'moe' if model else 'dense'}"
    config = tiny_config(mesh=saved_mesh, model=model, train=dict(steps=4))
    config.checkpoint.every = 2
    config.log.tensorboard = False
    if not (base / "checkpoints").exists():
        train(config, str(base), verbose=False)
    reference = losses_by_step(logged_steps(str(base)))

    workdir = tmp_path_factory.mktemp("reshard")
    shutil.copytree(base / "checkpoints", workdir / "checkpoints")
    other = tiny_config(mesh=mesh, model=model, train=dict(steps=4))
    other.checkpoint.resume = "2"
    other.checkpoint.every = 0
    other.log.tensorboard = False
    records = train(other, str(workdir), devices=jax.devices()[:devices], verbose=False)
    assert [r["step"] for r in records] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in records], [reference[3], reference[4]],
                               rtol=1e-5)


def test_async_save_is_safe_while_donating_steps_run(tmp_path):
    config = tiny_config(mesh=dict(fsdp=4, tensor=2), train=dict(steps=6))
    exp = Experiment.from_config(config)
    ckpt = Checkpointer(str(tmp_path), config.checkpoint)
    assert config.checkpoint.async_save
    state = exp.init_state()
    batches = host_batches(config, 6)
    state, _ = exp.compiled_step(state, exp.device_batch(batches[0]))
    saved = jax.device_get(state)
    ckpt.save(1, state, {"next_step": 2})
    for batch in batches[1:]:  # each call donates (and so deletes) the previous state
        state, _ = exp.compiled_step(state, exp.device_batch(batch))
    ckpt.wait()
    restored, data = ckpt.restore(1, exp.abstract_state)
    assert data == {"next_step": 2}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
    ckpt.close()


def test_sigterm_saves_and_exits_zero(tmp_path):
    workdir = str(tmp_path)
    proc = start(workdir, "--config.train.steps=100000", "--config.checkpoint.every=0")
    wait_for_step(proc, workdir, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    last = max(r["step"] for r in logged_steps(workdir))
    assert Checkpointer(workdir, tiny_config().checkpoint).steps() == [last]
    assert f"SIGTERM: saved checkpoint step {last}" in out


def test_ctrl_c_saves_exits_130_and_the_rerun_resumes_exactly(tmp_path):
    """The first Ctrl-C is acknowledged at once, finishes the step, saves, says so and
    exits 130 without a traceback; rerun, the run goes on from that checkpoint with the
    losses of a run never interrupted."""
    workdir = str(tmp_path / "run")
    proc = start(workdir, "--config.train.steps=100000", "--config.checkpoint.every=0")
    wait_for_step(proc, workdir, 2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert "Ctrl-C: saving after the current step, then exiting" in err
    last = max(r["step"] for r in logged_steps(workdir))
    assert Checkpointer(workdir, tiny_config().checkpoint).steps() == [last]
    assert f"Ctrl-C: saved checkpoint step {last} in " in out
    # The same command, to two steps more (the schedule is constant: train.steps
    # changes nothing else), resumes; a run never interrupted is the reference.
    rerun = start(workdir, f"--config.train.steps={last + 2}", "--config.checkpoint.every=0")
    out, err = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, err[-2000:]
    assert f"resumed from checkpoint step {last}" in out
    assert_resumed_like_uninterrupted(workdir, tmp_path / "reference", last + 2)


def test_a_second_ctrl_c_stops_at_once_without_a_traceback():
    """What train.py's loop listens with (ndjax.training.stop_signals), in a process of its own:
    the second Ctrl-C ends it at once (exit 130), one line each, no traceback."""
    code = ("import os, signal, time\n"
            "from ndjax.training.stop_signals import StopSignals\n"
            "s = StopSignals()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(0.2)\n"
            "assert s.requested == 'Ctrl-C', s.requested\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n"
            "print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "Ctrl-C: saving after the current step, then exiting (Ctrl-C again stops at once).",
        "Ctrl-C again: stopped at once; the checkpoints are intact up to the last complete "
        "one."]


def test_unfinished_save_is_ignored(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    # What a save cut short by kill -9 leaves behind: orbax's temporary directory.
    (ckpt_dir / "7.orbax-checkpoint-tmp-1764480000000000").mkdir(parents=True)
    (ckpt_dir / "7.orbax-checkpoint-tmp-1764480000000000" / "state").mkdir()
    ckpt = Checkpointer(str(tmp_path), tiny_config().checkpoint)
    assert ckpt.steps() == [] and ckpt.step_to_restore() is None


def refuse_resume(workdir) -> subprocess.CompletedProcess:
    """train.py asked to resume from step 7, which ``workdir`` does not have."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}", *TINY_FLAGS,
         "--config.checkpoint.resume=7"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_refused_resume_is_one_line_every_time(tmp_path):
    """A refused checkpoint.resume is exactly one line on stderr, exit 2, every time.

    The refusal comes right after orbax's CheckpointManager started deleting
    interrupted saves' temporary directories in a thread; a run that exited with
    that thread still running printed a traceback after the error (RuntimeError:
    cannot schedule new futures after interpreter shutdown) in about 1 run in 6.
    So: 12 runs, 2 at a time (load widens the race; no more, beside the other test
    worker on CI's 2 cores), half of them on an empty
    workdir (as reported) and half with 200 interrupted saves left to delete, which
    kept the thread running past the exit in every such run before the fix.
    """
    workdirs = [tmp_path / str(i) for i in range(12)]
    for workdir in workdirs[1::2]:
        for k in range(200):
            (workdir / "checkpoints" / f"{k}.orbax-checkpoint-tmp-{1764480000000000 + k}"
             ).mkdir(parents=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(refuse_resume, workdirs))
    wrong = []
    for workdir, result in zip(workdirs, results):
        expected = (f"train.py: error: checkpoint.resume=7: no complete checkpoint of that "
                    f"step in {workdir / 'checkpoints'}; there are none.\n")
        if (result.returncode, result.stderr) != (2, expected):
            wrong.append(f"{workdir.name}: exit {result.returncode}\n{result.stderr[-2000:]}")
    assert not wrong, f"{len(wrong)} of {len(workdirs)} runs:\n" + "\n".join(wrong)


def test_keep_prunes_old_checkpoints(tmp_path):
    config = tiny_config(mesh=dict(fsdp=8), train=dict(steps=5))
    config.checkpoint.every = 1
    config.checkpoint.keep = 2
    config.log.tensorboard = False
    train(config, str(tmp_path), verbose=False)
    assert Checkpointer(str(tmp_path), config.checkpoint).steps() == [4, 5]


def test_model_mismatch_is_a_clear_error(tmp_path):
    config = tiny_config(mesh=dict(fsdp=8), train=dict(steps=1))
    config.log.tensorboard = False
    train(config, str(tmp_path), verbose=False)
    other = tiny_config(mesh=dict(fsdp=8), model=dict(ffn_dim=192))
    with pytest.raises(ConfigError, match=r"layers/mlp/w_down of shape \(2, 128, 64\), but this "
                                          r"config's model needs \(2, 192, 64\)"):
        train(other, str(tmp_path), verbose=False)
    missing = tiny_config(mesh=dict(fsdp=8))
    missing.checkpoint.resume = "5"
    with pytest.raises(ConfigError, match=r"checkpoint.resume=5: no complete checkpoint"):
        train(missing, str(tmp_path), verbose=False)


def test_bf16_resume_is_bitwise_exact(tmp_path):
    """bf16 parameters, moments and compute: saved at step 4 and resumed, the run
    continues bitwise as the uninterrupted one (losses and final parameters)."""
    steps = 8
    config = tiny_config(mesh=dict(fsdp=4, tensor=2),
                         model=dict(param_dtype="bfloat16", dtype="bfloat16"),
                         train=dict(steps=steps, opt_state_dtype="bfloat16"))
    config.checkpoint.every = 4
    config.log.tensorboard = False
    reference = losses_by_step(train(config, str(tmp_path / "ref"), verbose=False))
    ref_ckpt = Checkpointer(str(tmp_path / "ref"), config.checkpoint)
    saved = ref_ckpt.manager.item_metadata(4)["state"]
    # bfloat16 parameters and mu; nu a float32 word that also holds mu's next bits
    # (ndjax.step.state.pack_moments).
    assert {m.dtype for m in jax.tree.leaves(saved) if m.shape} == {jnp.dtype(jnp.bfloat16),
                                                                   jnp.dtype(jnp.float32)}

    # The run as it was after step 4 (a fresh Experiment restores it).
    workdir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "4", workdir / "checkpoints" / "4")
    resumed = losses_by_step(train(config, str(workdir), verbose=False))
    assert sorted(resumed) == list(range(5, steps + 1))
    for step in resumed:
        assert resumed[step] == reference[step], step  # bitwise: same mesh, same program

    exp = Experiment.from_config(config)
    resumed_ckpt = Checkpointer(str(workdir), config.checkpoint)
    final, ref_final = (jax.device_get(c.restore(steps, exp.abstract_state)[0])
                        for c in (resumed_ckpt, ref_ckpt))
    assert final.params["embed"].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, final, ref_final)
    resumed_ckpt.close()
    ref_ckpt.close()


def test_a_live_runs_workdir_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    """A second train.py on the workdir of a live run (a job resubmitted while the first
    still runs) exits 2 with one line naming the holder, and the first run goes on
    untouched. A lock left by a dead process of this host, and a metrics.jsonl line
    torn by a crash, are each one warning: the rerun resumes with the losses of an
    uninterrupted run."""
    workdir = str(tmp_path / "run")
    first = start(workdir, "--config.train.steps=100000", "--config.checkpoint.every=0")
    wait_for_step(first, workdir, 2)
    first.send_signal(signal.SIGSTOP)  # alive, holding the workdir, for as long as it takes
    try:
        env = {**os.environ, "PYTHONPATH": ROOT}
        second = subprocess.run(
            [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/llama_fsdp.py",
             f"--workdir={workdir}", *TINY_FLAGS], cwd=ROOT, env=env, capture_output=True,
            text=True, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)  # (it saves and ends, whatever the test finds)
    out, err = first.communicate(timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stderr.splitlines() == [second.stderr.strip()], second.stderr[-2000:]
    assert second.stderr.startswith("train.py: error: ") and "in use by another run (pid " \
        f"{first.pid} on host {socket.gethostname()!r}, since " in second.stderr, second.stderr
    assert "wait for it to finish, stop it, or use another --workdir" in second.stderr
    assert first.returncode == 0, err[-2000:]
    last = max(r["step"] for r in logged_steps(workdir))
    assert [r["step"] for r in logged_steps(workdir)] == list(range(1, last + 1))
    assert Checkpointer(workdir, tiny_config().checkpoint).steps() == [last]

    # A dead process of this host, as kill -9 or a crash would leave it (the kernel
    # dropped its flock, the file still names it), and a half-written last line.
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    with open(os.path.join(workdir, ".lock"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": dead.pid, "since": "earlier"}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(f'{{"step": {last + 1}, "loss": 0.')
    again = start(workdir, f"--config.train.steps={last + 2}")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    assert f"resumed from checkpoint step {last}" in out
    warned = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(warned) == 2 and all(w.startswith("train.py: warning: ") for w in warned), \
        err[-2000:]
    assert f"taking over the lock of a run that is gone (pid {dead.pid} on host" in warned[0]
    assert "metrics.jsonl: left out 1 line(s)" in warned[1]


    assert_resumed_like_uninterrupted(workdir, tmp_path / "ref", last + 2)


# What limit_file_size runs before train.py, in the child: writes past 64 KiB in any
# one file fail with EFBIG, "File too large" (as root too: RLIMIT_FSIZE is no
# permission bit). The tiny model's checkpoint has larger array files; its metrics and
# config files are smaller. SIGXFSZ ignored (exec keeps both), or the first such write
# would kill the process instead of failing. (Not subprocess's preexec_fn: it forks
# this multithreaded process and runs Python in the child.)
_LIMITED = ("import os, resource, signal, sys; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, "
            "(64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def run_train(workdir, *args, limit_file_size=False) -> subprocess.CompletedProcess:
    """train.py (the tiny model of TINY_FLAGS, config llama_fsdp) to completion."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    limited = ["-c", _LIMITED] if limit_file_size else []
    return subprocess.run(
        [sys.executable, *limited, os.path.join(ROOT, "train.py"),
         "--config=configs/llama_fsdp.py", f"--workdir={workdir}", *TINY_FLAGS, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """The losses of an uninterrupted 6-step run, in process (as test_kill_9_...)."""
    config = tiny_config(mesh=dict(fsdp=8), train=dict(steps=6))
    config.log.tensorboard = False
    return losses_by_step(train(config, str(tmp_path_factory.mktemp("ref6")), verbose=False))


def cut_short(step_dir) -> str:
    """Truncates the largest array data file of a checkpoint to a third: what a host
    crash or a bad disk leaves. Orbax's OCDBT layout: state/ocdbt.process_<i>/d/*."""
    data = step_dir / "state" / "ocdbt.process_0" / "d"
    largest = max(data.iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 3)
    return str(largest)


def test_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path, six_steps):
    """The newest checkpoint cut short: resume=auto moves it to <step>.unreadable (kept,
    and neither a step nor an interrupted save to orbax) with one warning line, and
    resumes from the one before as the uninterrupted run; on_unreadable=stop and an
    explicit resume=<that step> are one-line errors, exit 2, that leave it in place."""
    workdir = tmp_path / "run"
    first = run_train(workdir, "--config.train.steps=4", "--config.checkpoint.every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt_dir = workdir / "checkpoints"
    cut = cut_short(ckpt_dir / "4")

    for name in ("stop", "asked", "bad"):
        shutil.copytree(workdir, tmp_path / name)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        (_, resumed), (stopped_dir, stopped), (asked_dir, asked), (_, bad) = pool.map(
            lambda a: (tmp_path / a[0], run_train(tmp_path / a[0], "--config.train.steps=6",
                                                  "--config.checkpoint.every=2", *a[1:])),
            [("run",), ("stop", "--config.checkpoint.on_unreadable=stop"),
             ("asked", "--config.checkpoint.resume=4"),
             ("bad", "--config.checkpoint.on_unreadable=maybe")])
    error = r"OUT_OF_RANGE: Error reading [^\n]* in OCDBT database at local file [^\n]*"
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    where = re.escape(str(ckpt_dir))
    assert re.fullmatch(
        rf"train.py: warning: checkpoint step 4 in {where} does not read \({error}\); moved it to "
        rf"{where}/4.unreadable and resumed from step 2.\n", resumed.stderr), resumed.stderr
    assert "resumed from checkpoint step 2\n" in resumed.stdout
    losses = losses_by_step(logged_steps(workdir))
    assert sorted(losses) == list(range(1, 7))
    for step in range(3, 7):
        assert losses[step] == six_steps[step], step  # bitwise: same mesh, same program
    # Moved, not deleted; a new manager (which cleans up interrupted saves) neither
    # lists nor removes it.
    moved = cut.replace(f"{os.sep}4{os.sep}", f"{os.sep}4.unreadable{os.sep}")
    assert os.path.getsize(moved) > 0
    ckpt = Checkpointer(str(workdir), tiny_config().checkpoint)
    assert ckpt.steps() == [2, 4, 6]
    ckpt.close()
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4", "4.unreadable", "6"]

    stop_dir, asked_ckpts = (re.escape(str(d / "checkpoints")) for d in (stopped_dir, asked_dir))
    for result, directory, expected in [
            (stopped, stopped_dir, rf"checkpoint step 4 in {stop_dir} does not read \({error}\); "
             rf"checkpoint.on_unreadable=stop. Move it aside \(mv {stop_dir}/4 "
             rf"{stop_dir}/4.unreadable\) or set --config.checkpoint.on_unreadable=fallback to "
             r"resume from the newest one that reads."),
            (asked, asked_dir, rf"checkpoint.resume=4: checkpoint step 4 in {asked_ckpts} does "
             rf"not read \({error}\). Resume from another step \(there are \[2, 4\]\) or use "
             r"checkpoint.resume=auto to fall back to the newest one that reads.")]:
        assert result.returncode == 2, result.stderr[-3000:]
        assert re.fullmatch(rf"train.py: error: {expected}\n", result.stderr), result.stderr
        assert sorted(os.listdir(directory / "checkpoints")) == ["2", "4"]
    assert (bad.returncode, bad.stderr) == (2, "train.py: error: checkpoint.on_unreadable="
                                               "'maybe': choose one of ('fallback', 'stop').\n")


def test_failed_save_is_one_line_and_a_rerun_resumes_exactly(tmp_path, six_steps):
    """A save that cannot be written (here: the file-size limit, as a full disk or a
    quota fail it) stops the run with one line naming the step, the directory and the
    OS error, exit 1, whether its async failure surfaces at the next save (step 6) or
    at the end of the run (step 4); the checkpoint before it stays, and a rerun
    resumes from it as the uninterrupted run."""
    workdir = tmp_path / "run"
    first = run_train(workdir, "--config.train.steps=2", "--config.checkpoint.every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt_dir = workdir / "checkpoints"
    expected = (f"train.py: error: checkpoint step 4 could not be saved in {ckpt_dir}: File "
                "too large (errno 27). Training stopped; the checkpoints before it are intact "
                "(newest: step 2) and a rerun resumes from it. Free space (or raise the quota "
                "or file-size limit) and run again.\n")
    for steps in (6, 4):
        failed = run_train(workdir, f"--config.train.steps={steps}",
                           "--config.checkpoint.every=2", limit_file_size=True)
        assert (failed.returncode, failed.stderr) == (1, expected), failed.stderr[-3000:]
        on_disk = Checkpointer(str(workdir), tiny_config().checkpoint, read_only=True)
        assert on_disk.steps() == [2]
        on_disk.close()

    resumed = run_train(workdir, "--config.train.steps=6", "--config.checkpoint.every=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 2\n" in resumed.stdout
    losses = losses_by_step(logged_steps(workdir))
    assert sorted(losses) == list(range(1, 7))
    np.testing.assert_allclose([losses[s] for s in range(3, 7)],
                               [six_steps[s] for s in range(3, 7)], rtol=1e-6)


def file_bytes(directory) -> dict[str, bytes]:
    """Every file under ``directory``, by its path relative to it."""
    root = pathlib.Path(directory)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_resume_from_an_older_step_keeps_the_newer_ones_until_it_has_saved(tmp_path, six_steps):
    """checkpoint.resume=2 on checkpoints 2, 4, 6 moves 4 and 6 aside to
    <step>.superseded, which orbax does not list. Killed before its first save, the run
    leaves them whole (renamed back, they resume), and the same command run again
    resumes the new timeline from 2; once that run has saved, they are deleted (as are
    those a run moved aside itself, once it has saved), and a plain restart resumes
    from its newest checkpoint, with the losses of a run never interrupted."""
    workdir = tmp_path / "run"
    first = run_train(workdir, "--config.train.steps=6", "--config.checkpoint.every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt_dir = workdir / "checkpoints"
    before = {step: file_bytes(ckpt_dir / str(step)) for step in (4, 6)}

    # checkpoint.every=0 and no end in sight: nothing is saved before the kill.
    resume_2 = ["--config.checkpoint.resume=2", "--config.checkpoint.every=0"]
    killed = start(workdir, *resume_2, "--config.train.steps=100000")
    expected = (f"resumed from checkpoint step 2; moved newer checkpoints [4, 6] aside as "
                f"<step>.superseded in {ckpt_dir}: this run replaces them, and deletes them "
                "once it has saved a checkpoint\n")
    for line in killed.stdout:  # the resumed line comes after the move, before any step
        if line.startswith("resumed from"):
            break
    else:
        line = ""
    killed.kill()
    _, err = killed.communicate(timeout=120)
    assert line.startswith("resumed from checkpoint step 2"), err[-2000:]
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4.superseded", "6.superseded"]
    assert line == expected
    for step in (4, 6):
        assert file_bytes(ckpt_dir / f"{step}.superseded") == before[step], step
    on_disk = Checkpointer(str(workdir), tiny_config().checkpoint, read_only=True)
    assert on_disk.steps() == [2]
    on_disk.close()

    # Renamed back (in a copy), the old timeline resumes from 6 (reading all of it; no
    # steps left). The same command as the killed run's, to step 5, resumes from 2.
    recovered = tmp_path / "recovered"
    shutil.copytree(workdir, recovered)
    for step in (4, 6):
        os.rename(recovered / "checkpoints" / f"{step}.superseded",
                  recovered / "checkpoints" / str(step))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        old, new = pool.map(lambda a: run_train(*a), [
            (recovered, "--config.train.steps=6"),
            (workdir, *resume_2[:1], "--config.train.steps=5", "--config.checkpoint.every=2")])
    assert old.returncode == 0, old.stderr[-2000:]
    assert "resumed from checkpoint step 6\n" in old.stdout, old.stdout
    assert new.returncode == 0, new.stderr[-2000:]
    assert "resumed from checkpoint step 2\n" in new.stdout, new.stdout
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4", "5"]
    # A run that moves one aside itself and ends deletes it too, once its save is whole.
    again = run_train(recovered, "--config.checkpoint.resume=4", "--config.train.steps=5")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from checkpoint step 4; moved newer checkpoints [6] aside" in again.stdout
    assert sorted(os.listdir(recovered / "checkpoints")) == ["2", "4", "5"]

    plain = run_train(workdir, "--config.train.steps=6")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "resumed from checkpoint step 5\n" in plain.stdout, plain.stdout
    losses = losses_by_step(logged_steps(workdir))
    assert sorted(losses) == list(range(1, 7))
    for step in range(3, 7):
        assert losses[step] == six_steps[step], step  # bitwise: same mesh, same program
