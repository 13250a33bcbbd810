"""4D: replica x fsdp x context x tensor = 2 x 2 x 2 x 2 (16 devices).

On a CPU-only host 16 devices are simulated (runtime.cpu_devices=16). Context
(ring attention) and tensor groups sit on neighbouring devices, replicas
outermost; see ndjax/parallel/mesh.py.
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.replica = 2
    c.mesh.fsdp = 2
    c.mesh.context = 2
    c.mesh.tensor = 2
    c.rules = "default"
    c.runtime.cpu_devices = 16
    return c
