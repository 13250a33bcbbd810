"""Tensor parallelism (Megatron column/row split) over all 8 devices.

The tiny preset has 4 kv heads, so this config uses 8 kv heads (multi-head
attention) to let tensor=8 split whole heads.
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.fsdp = 1
    c.mesh.tensor = -1
    c.model.n_kv_heads = 8
    c.rules = "default"
    return c
