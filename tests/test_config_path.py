"""The config is handed down: followed from ``loop.train`` through a run that does
everything a run can (data, evaluation, samples, checkpoints, an export), it is read
in a few modules, each layer reads its own section only, and no call hands it back up
to a module it came through."""

import collections
import dataclasses
import sys

import ml_collections
import pytest
from conftest import tiny_config

from ndjax import config as config_lib
from ndjax.training import loop

SECTIONS = tuple(t for t in vars(config_lib).values()
                 if isinstance(t, type) and dataclasses.is_dataclass(t)
                 and t.__name__.endswith("Settings"))


def _ndjax_path(frame) -> tuple[str, ...]:
    """The ndjax modules on the call stack, outermost first, repeats collapsed."""
    path: list[str] = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("ndjax") and (not path or path[-1] != module):
            path.append(module)
        frame = frame.f_back
    return tuple(reversed(path))


@pytest.fixture
def reads(monkeypatch):
    """Every read of a config field (a typed section or the ConfigDict) by ndjax code
    outside ndjax.config: (reading module, type read, call path) -> count."""
    seen: collections.Counter = collections.Counter()
    for cls in (*SECTIONS, ml_collections.ConfigDict):
        original = cls.__getattribute__

        def read(self, name, _original=original, _cls=cls):
            if not name.startswith("__"):
                frame = sys._getframe(1)
                module = frame.f_globals.get("__name__", "")
                if module.startswith("ndjax") and module != "ndjax.config":
                    seen[module, _cls.__name__, _ndjax_path(frame)] += 1
            return _original(self, name)

        monkeypatch.setattr(cls, "__getattribute__", read)
    return seen


def test_the_config_runs_down_the_layers(tmp_path, reads):
    c = tiny_config(mesh=dict(fsdp=4, tensor=2))
    c.train.steps, c.train.eval_every, c.train.eval_steps = 2, 2, 1
    c.checkpoint.every = 1
    c.log.sample_every, c.log.sample_prompt, c.log.sample_tokens = 2, "ab", 2
    c.export.hf_dir = str(tmp_path / "hf")
    loop.train(c, str(tmp_path / "run"), verbose=False)

    modules = {module for module, _, _ in reads}
    # Measured: 9 (the experiment, the loop and its summary, the data loader, the optimizer's
    # state, the checkpointer, the workdir, the Hugging Face export, and the trackers, which
    # give W&B and MLflow the settings as the run's parameters).
    assert 0 < len(modules) <= 9, "\n".join(sorted(modules))
    # The raw config is read where it is written to the workdir (config.json, and a resume's
    # model taken from there) and nowhere else: below the experiment, typed sections only.
    raw = {module for module, kind, _ in reads if kind == "ConfigDict"}
    assert raw <= {"ndjax.runs.workdir"}, raw
    # A module that hands the config down never gets it back from below.
    upward = {" > ".join(path) for _, _, path in reads if len(set(path)) < len(path)}
    assert not upward, upward
    # The data layer reads its own section (handed down in a DataInput), nothing else.
    data_reads = {kind for module, kind, _ in reads if module.startswith("ndjax.data")}
    assert data_reads == {"DataSettings"}, data_reads
    # And the hooks only what they are given: no section of the config.
    assert not {kind for module, kind, _ in reads if module == "ndjax.training.hooks"}
