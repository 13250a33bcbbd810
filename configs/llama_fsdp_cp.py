"""FSDP x context parallelism: batch and parameters over fsdp=4, sequence over context=2.

Attention (model.cp_impl=auto): zigzag ring attention over the context axis on CPUs;
on GPUs all-to-all, each device running cuDNN over the whole sequence for its heads.
Parameters are FSDP-sharded over fsdp x context (Accelerate's dp_shard x cp group).
For long sequences raise train.seq_len (a multiple of 2 x context = 4) and lower
train.batch_size, e.g. --config.train.seq_len=8192 --config.train.batch_size=4.
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.fsdp = 4
    c.mesh.context = 2
    c.rules = "default"
    c.model.cp_layout = "zigzag"
    return c
