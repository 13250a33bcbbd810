"""FSDP x tensor parallelism on 4 x 2 devices: the tiny Qwen 2 MoE (8 experts, the top 2
per token, and a shared expert every token runs through; the experts' and the shared
expert's widths split over tensor).

    python train.py --config=configs/qwen2_moe_fsdp_tp.py
    python train.py --config=configs/qwen2_moe_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (its config.json sets the model), for
example Qwen/Qwen1.5-MoE-A2.7B.
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "qwen2_moe"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
