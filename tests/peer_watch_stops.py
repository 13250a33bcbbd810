"""Two processes stop their peer watches together, many times, at skewed moments.

Run by tests/test_multiprocess.py::test_peer_watches_stop_together_at_any_skew as
``python tests/peer_watch_stops.py PORT PROCESS_ID ROUNDS``; prints "stopped N" and
exits 0, or hangs (the test kills it). Each round is what distributed.finish does:
a barrier, stop(together=True), a barrier, with a random delay before the stop. Process 1's
watch asks every 2 ms, process 0's every 50 ms (on a loaded machine the same interval
drifts apart so): process 0 mostly stops between asks while process 1's ask waits for it.
"""

import random
import sys
import time

from ndjax.config import default_config
from ndjax.parallel import distributed


def main(port: int, process_id: int, rounds: int) -> None:
    config = default_config()
    config.runtime.coordinator = f"127.0.0.1:{port}"
    config.runtime.num_processes, config.runtime.process_id = 2, process_id
    config.runtime.cpu_devices = 1

    def never(message: str) -> None:
        raise SystemExit(f"report called: {message}")

    distributed.initialize(config.runtime, on_timeout=never)
    kv, rng = distributed.client(), random.Random(process_id)
    for i in range(rounds):
        watch = distributed.PeerWatch(
            lambda m: print(f"lost: {m}", flush=True), heartbeat_timeout=30,
            interval=0.05 if process_id == 0 else 0.002)
        time.sleep(rng.uniform(0, 0.05))
        kv.wait_at_barrier(f"round/{i}", 60_000)
        time.sleep(rng.uniform(0, 0.02))
        watch.stop(together=True)
        kv.wait_at_barrier(f"stopped/{i}", 60_000)  # no one asks again before all stopped
    print(f"stopped {rounds}", flush=True)
    distributed.leave()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
