"""Multi-process settings, checked in one process (the real processes are in
test_multiprocess.py)."""

import pytest
from conftest import tiny_config

from ndjax.config import default_config
from ndjax.experiment import slow_axes_warning
from ndjax.parallel import distributed
from ndjax.parallel.mesh import ParallelDims, build_mesh
from ndjax.runtime.errors import ConfigError

LAUNCHER_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE",
                 "JAX_COORDINATOR_ADDRESS")


@pytest.fixture
def no_launcher(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def runtime(**fields):
    r = default_config().runtime
    r.update(fields)
    return r


@pytest.mark.parametrize("fields, message", [
    (dict(coordinator="node0", num_processes=2, process_id=0), "must be host:port"),
    (dict(num_processes=0), "runtime.num_processes=0 must be >= 1"),
    (dict(num_processes=2, process_id=2), "runtime.process_id=2 must be in 0..1"),
    (dict(coordinator="node0:1234"), "runtime.coordinator set but runtime.num_processes, "
                                     "runtime.process_id not"),
    (dict(num_processes=2, process_id=1), "runtime.coordinator not"),
    (dict(init_timeout=0), "runtime.init_timeout=0 must be a positive"),
    (dict(local_device_ids="0,1,1"), "must list distinct GPU indices"),
    (dict(local_device_ids="gpu0"), "must list distinct GPU indices"),
])
def test_bad_runtime_fields(no_launcher, fields, message):
    with pytest.raises(ConfigError, match=message):
        distributed.check_runtime(runtime(**fields))


def test_a_single_process_needs_no_settings(no_launcher):
    assert not distributed.wants_distributed(runtime())
    assert distributed.wants_distributed(runtime(num_processes=2, process_id=0))


@pytest.mark.parametrize("env, processes", [
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16"}, 16),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, 1),  # srun -n 1
    ({"OMPI_COMM_WORLD_SIZE": "4"}, 4),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, 2),
    ({}, 1),
])
def test_launcher_environment(no_launcher, monkeypatch, env, processes):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert distributed.launcher_processes() == processes
    assert distributed.wants_distributed(runtime()) == (processes > 1)


def test_config_comparison_ignores_only_the_process_id():
    a, b = tiny_config(), tiny_config()
    b.runtime.process_id = 1
    assert distributed._shared_config(a) == distributed._shared_config(b)
    b.mesh.fsdp = 4
    flat_a = distributed._flatten(distributed._shared_config(a))
    flat_b = distributed._flatten(distributed._shared_config(b))
    assert [k for k in flat_a if flat_a[k] != flat_b[k]] == ["mesh.fsdp"]


def test_tensor_across_hosts_warns(cpu_devices):
    def two_hosts(d):  # pretend devices 0-3 are one machine and 4-7 another
        return "node0" if d.id < 4 else "node1"

    across = build_mesh(ParallelDims(fsdp=1, tensor=8), cpu_devices)
    message = slow_axes_warning(across, two_hosts)
    assert "mesh.tensor=8) spans hosts" in message and "(4 devices each)" in message
    inside = build_mesh(ParallelDims(fsdp=2, tensor=4), cpu_devices)
    assert slow_axes_warning(inside, two_hosts) is None
    assert slow_axes_warning(across, lambda d: "one host") is None


def test_single_process_feeds_every_row(cpu_devices):
    from ndjax.experiment import Experiment
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2)))
    assert exp.local_rows == (0, 8)


def test_local_device_ids():
    assert distributed.local_device_ids(runtime()) is None
    assert distributed.local_device_ids(runtime(local_device_ids="0, 1,2,3")) == [0, 1, 2, 3]
