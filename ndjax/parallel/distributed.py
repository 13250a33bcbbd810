"""Joining processes into one run: jax.distributed start-up and its checks.

One process per host (or per GPU) runs train.py; ``jax.distributed`` connects
them through a coordinator (process 0), after which ``jax.devices()`` lists
every process's devices and one mesh spans them all. On GPUs NCCL carries the
collectives; on CPU hosts (tests, trying it out) gloo does.

``initialize`` must run before anything creates a JAX backend. A single-process
run needs no settings: nothing is initialized unless the config or a launcher
(SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``) says there are several processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from ndjax.runtime.errors import ConfigError

# Config fields that may differ between the processes of one run.
PER_PROCESS_FIELDS = ("runtime.process_id",)


def client() -> Any:
    # The distributed client is not public API; it is the one channel that
    # works before (and independently of) any device computation.
    from jax._src.distributed import global_state
    return global_state.client


def launcher_processes() -> int:
    """How many processes a launcher started, from its environment (1 if none)."""
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        return int(os.environ["SLURM_STEP_NUM_TASKS"])  # srun, not just inside sbatch
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return 2  # jax's own variable: the run is multi-process, jax finds the rest
    return 1


def wants_distributed(runtime: ml_collections.ConfigDict) -> bool:
    explicit = runtime.coordinator is not None or (runtime.num_processes or 1) > 1
    return explicit or launcher_processes() > 1


def check_runtime(runtime: ml_collections.ConfigDict) -> None:
    """The runtime.* fields, before anything starts."""
    if runtime.coordinator is not None:
        host, _, port = str(runtime.coordinator).rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"runtime.coordinator={runtime.coordinator!r} must be host:port of process 0, "
                "e.g. runtime.coordinator=10.0.0.1:1234.")
    n, pid = runtime.num_processes, runtime.process_id
    if n is not None and n < 1:
        raise ConfigError(f"runtime.num_processes={n} must be >= 1.")
    if pid is not None and n is not None and not 0 <= pid < n:
        raise ConfigError(f"runtime.process_id={pid} must be in 0..{n - 1} "
                          f"(runtime.num_processes={n}).")
    given = {"runtime.coordinator": runtime.coordinator, "runtime.num_processes": n,
             "runtime.process_id": pid}
    missing = [k for k, v in given.items() if v is None]
    if wants_distributed(runtime) and launcher_processes() == 1 and missing:
        raise ConfigError(
            f"{', '.join(k for k in given if k not in missing)} set but {', '.join(missing)} "
            "not, and no launcher (srun, mpirun) provides them: set all three on every "
            "process (only runtime.process_id differs).")
    local_device_ids(runtime)
    for field in ("init_timeout", "heartbeat_timeout"):
        if runtime[field] <= 0:
            raise ConfigError(f"runtime.{field}={runtime[field]} must be a positive number of "
                              "seconds.")


def local_device_ids(runtime: ml_collections.ConfigDict) -> list[int] | None:
    """runtime.local_device_ids ("0,1,2,3") as a list; None when unset."""
    text = runtime.local_device_ids
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError(
            f"runtime.local_device_ids={text!r} must list distinct GPU indices separated by "
            "commas, e.g. runtime.local_device_ids=0,1,2,3,4,5,6,7.")
    return [int(p) for p in parts]


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def initialize(runtime: ml_collections.ConfigDict, on_timeout: Callable[[str], None]) -> None:
    """Joins the other processes of the run, if there are any. Call it first.

    If the processes have not all met within ``runtime.init_timeout`` seconds
    (no coordinator, or a process never started), ``on_timeout(message)`` is
    called from a timer thread and must end the process: jax itself would abort
    with a stack dump once its own (longer) deadline passed. Later, a process
    silent for ``runtime.heartbeat_timeout`` seconds is reported by PeerWatch.
    """
    check_runtime(runtime)
    # Simulated devices per process on CPU hosts (harmless on GPU hosts); gloo
    # carries CPU collectives between processes.
    jax.config.update("jax_num_cpu_devices", int(runtime.cpu_devices))
    if not wants_distributed(runtime):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # By default the coordination service kills every process, with its own
    # message, when one stops sending heartbeats. In "recoverable" mode it only
    # marks that process dead, and PeerWatch reports it by ndjax's process ids.
    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # a jax without it: its own message and abort remain
        pass
    coordinator = runtime.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    timeout = float(runtime.init_timeout)

    def timed_out() -> None:
        where = coordinator or "(from the launcher's environment)"
        if coordinator and runtime.process_id != 0 and not _reachable(coordinator):
            message = (f"no answer from the coordinator {where} within runtime.init_timeout="
                       f"{timeout:g} s. Check that process 0 is running, that every process "
                       "uses the same host:port, and that the port is reachable.")
        else:
            message = (f"not all {runtime.num_processes or 'expected'} processes joined the "
                       f"coordinator {where} within runtime.init_timeout={timeout:g} s. Start "
                       "every process (ids 0 .. runtime.num_processes-1) with the same "
                       "runtime.coordinator.")
        on_timeout(message)

    timer = threading.Timer(timeout, timed_out)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=runtime.coordinator,
            num_processes=runtime.num_processes,
            process_id=runtime.process_id,
            local_device_ids=local_device_ids(runtime),
            # Ours fires first: jax's own deadline aborts the process.
            initialization_timeout=int(timeout) + 60,
            heartbeat_timeout_seconds=int(runtime.heartbeat_timeout))
    finally:
        timer.cancel()
    keep = os.environ.get("NDJAX_KEEP_CPU_COMPILATION_CACHE") == "1"
    if jax.default_backend() == "cpu" and jax.config.jax_enable_compilation_cache and not keep:
        # Seen with jax 0.10.2: two-process CPU runs that loaded executables
        # from a shared persistent compilation cache hung in gloo context set-up
        # ("Gloo context initialization failed ... GetKeyValue() timed out") in
        # 6 of about 50 runs; 0 of 27 compiled afresh. Suggestive, not proof (the
        # trigger is not pinned down; bench/gloo_cache_hang.py, which sets the
        # variable above, saw 0 of 8), and CPU multi-process runs are for trying
        # things out, so they compile afresh as a precaution.
        jax.config.update("jax_enable_compilation_cache", False)


def label() -> str:
    """'process 1 of 2: ' in a multi-process run, '' otherwise (for messages)."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        return f"process {jax.process_index()} of {jax.process_count()}: "
    return ""


def _shared_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
    flat = json.loads(config.to_json_best_effort(sort_keys=True))
    for field in PER_PROCESS_FIELDS:
        group, key = field.split(".")
        flat.get(group, {}).pop(key, None)
    return flat


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


# The host each process runs on, by process index (learned in handshake).
_hosts: list[str] = []


def host_of(device: jax.Device) -> str:
    """The host (machine) of ``device``'s process; one name in a single process."""
    return _hosts[device.process_index] if _hosts else socket.gethostname()


def handshake(config: ml_collections.ConfigDict, timeout_s: float = 120.0) -> None:
    """Start-up exchange between the processes: their hosts, and their configs,
    which must be the same (bar the process id).

    Each process publishes both through the coordinator's key-value store, not
    a device collective (a mismatched mesh could not even compile one). On a
    config mismatch, all processes raise the same ConfigError, naming the
    processes and fields that differ.
    """
    if jax.process_count() == 1:
        return
    kv = client()
    me, n = jax.process_index(), jax.process_count()
    timeout_ms = int(timeout_s * 1000)
    kv.key_value_set(f"ndjax/host/{me}", socket.gethostname())
    _hosts[:] = [kv.blocking_key_value_get(f"ndjax/host/{i}", timeout_ms) for i in range(n)]
    text = json.dumps(_shared_config(config), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    kv.key_value_set(f"ndjax/config/{me}", text)
    kv.key_value_set(f"ndjax/config_hash/{me}", digest)
    hashes = [kv.blocking_key_value_get(f"ndjax/config_hash/{i}", timeout_ms)
              for i in range(n)]
    differing = [i for i in range(n) if hashes[i] != hashes[0]]
    if not differing:
        return
    reference = _flatten(json.loads(kv.blocking_key_value_get("ndjax/config/0", timeout_ms)))
    other = _flatten(json.loads(kv.blocking_key_value_get(
        f"ndjax/config/{differing[0]}", timeout_ms)))
    # Everyone has read what it needs before anyone exits (process 0's exit
    # takes the coordinator with it).
    kv.wait_at_barrier("ndjax/config_checked", timeout_ms)
    fields = sorted(k for k in reference.keys() | other.keys()
                    if reference.get(k) != other.get(k))
    first = differing[0]
    shown = ", ".join(f"{k}={other.get(k)!r} (process 0: {reference.get(k)!r})"
                      for k in fields[:5]) + (", ..." if len(fields) > 5 else "")
    who = (f"process {first} runs" if len(differing) == 1 else
           f"processes {', '.join(map(str, differing))} run")
    raise ConfigError(
        f"{who} a different config from process 0; process {first}: {shown}. "
        "Start every process with the same config file and --config flags.")


class PeerWatch:
    """Watches the other processes; reports a lost one instead of hanging.

    A dead peer leaves the others blocked in a collective (NCCL) or failing one
    with an opaque transport error (gloo). A thread asks the coordinator which
    processes are alive every ``interval`` seconds; once one is missing (it sent
    no heartbeat for runtime.heartbeat_timeout seconds) or the coordinator
    itself is unreachable, it calls ``report(message)``, which must end the
    process.

    The coordinator answers that question as a barrier: a process's k-th ask
    returns once every live process has asked k times (or left). When every
    process stops watching at the end of a run, the watches must stop after the
    same ask, or one waits forever for a peer that stopped asking but has not
    left: see ``stop(together=True)``.
    """

    _made = 0  # watches made in this process: a key of their own for each

    def __init__(self, report: Callable[[str], None], heartbeat_timeout: float,
                 interval: float = 1.0):
        self.report, self.heartbeat_timeout = report, heartbeat_timeout
        self.interval = interval
        self._stop, self._together = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        PeerWatch._made += 1
        self._last_ask_key = f"ndjax/peer_watch/{PeerWatch._made}/last_ask"
        if jax.process_count() > 1:
            self._thread = threading.Thread(target=self._run, name="ndjax-peer-watch",
                                            daemon=True)
            self._thread.start()

    def lost(self) -> str | None:
        """A message naming the lost processes, or None while all are alive."""
        n = jax.process_count()
        try:
            alive = set(client().get_live_nodes(list(range(n))))
        except Exception as e:  # noqa: BLE001 -- any failure here means no coordinator
            return (f"lost the coordinator (process 0): {' '.join(str(e).split())[:200]}. "
                    "Process 0 was killed, crashed or was preempted, or the network to it "
                    "failed.")
        missing = sorted(set(range(n)) - alive)
        if not missing:
            return None
        which = ", ".join(map(str, missing))
        return (f"lost process{'es' if len(missing) > 1 else ''} {which}: it disconnected "
                "from the coordinator or sent no heartbeat for runtime.heartbeat_timeout="
                f"{self.heartbeat_timeout:g} s (killed, crashed, preempted or cut off).")

    def _run(self) -> None:
        asks = 0
        while True:
            self._stop.wait(self.interval)  # returns at once when stopping
            message = self.lost()
            asks += 1
            if message is not None:
                if not self._stop.is_set():
                    self.report(message)
                return
            if self._together.is_set() and self._last_ask() is None:
                # The first to stop together names the ask after this one as the
                # last: every watch has made `asks` asks (each waited for the
                # others'), and all read the key before their next ask returns.
                with contextlib.suppress(Exception):  # another process wrote it first
                    client().key_value_set(self._last_ask_key, str(asks + 1))
            last = self._last_ask()
            if last is not None and asks >= last:
                return
            if self._stop.is_set() and not self._together.is_set():
                return

    def _last_ask(self) -> int | None:
        try:
            value = client().key_value_try_get(self._last_ask_key)
        except Exception:  # noqa: BLE001 -- not written yet (or no coordinator: the next ask says)
            return None
        return int(value)

    def wait_for_verdict(self) -> None:
        """After a failed collective: give the watch time to name the lost process
        (the report ends the process); returns if every process still looks alive."""
        if self._thread is not None:
            self._thread.join(self.heartbeat_timeout + 5 * self.interval)

    def stop(self, together: bool = False) -> None:
        """Stops watching. ``together``: every process is stopping its watch now
        (all have reached the end of the run), and each returns once all watches
        have made their last ask; the key that names it tells a watch to stop even
        before its own process says so. Otherwise the others' watches go on, and
        report this process once it leaves."""
        if together:
            self._together.set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def finish(watch: PeerWatch, timeout_s: float = 600.0) -> None:
    """The end of a successful run. The processes wait for each other with the
    watch still on (a process that died instead of finishing is reported), then
    all stop watching before anyone disconnects (a peer leaving is not lost)."""
    if jax.process_count() == 1:
        watch.stop()
        return
    kv = client()
    kv.wait_at_barrier("ndjax/finished", int(timeout_s * 1000))
    watch.stop(together=True)
    kv.wait_at_barrier("ndjax/unwatched", int(timeout_s * 1000))
    leave()


def leave(timeout_s: float = 30.0) -> None:
    """Disconnects this process. Process 0 first waits (at most ``timeout_s``) for
    the others to go: it hosts the coordinator, and a worker that loses it before
    exiting is killed by jax with an unrelated message."""
    if not jax.distributed.is_initialized():
        return
    if jax.process_index() == 0:
        everyone = list(range(jax.process_count()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if set(client().get_live_nodes(everyone)) <= {0}:
                    break
            except Exception:  # noqa: BLE001 -- nothing left to wait for
                break
            time.sleep(0.1)
    jax.distributed.shutdown()
