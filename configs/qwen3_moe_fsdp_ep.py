"""FSDP x expert parallelism on 2 x 4 devices: the tiny Qwen3-MoE (8 experts, the top 2
per token), each device holding 2 of the experts; the (token, expert) pairs travel to
their experts' devices and back in ragged all-to-alls. The other weights are FSDP-split
over fsdp x expert, and the batch over both.

    python train.py --config=configs/qwen3_moe_fsdp_ep.py
    python train.py --config=configs/qwen3_moe_fsdp_ep.py --config.model.init_from=DIR
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "qwen3_moe"
    c.mesh.fsdp = 2
    c.mesh.expert = 4
    c.rules = "default"
    c.train.seq_len = 128
    return c
