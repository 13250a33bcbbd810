"""Pipeline stages x FSDP: tiny Llama's 8 layers as 2 stages of 4, each stage's
layers FSDP-sharded over 4 devices; each step's batch runs through the stages as 4
micro-batches (GPipe: the stages idle (2-1)/(4+2-1) = 20% of the time)."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.stage = 2
    c.mesh.fsdp = 4
    c.train.microbatches = 4
    c.train.batch_size = 16  # 4 micro-batches of 4 rows, one per fsdp shard
    c.train.seq_len = 128
    return c
