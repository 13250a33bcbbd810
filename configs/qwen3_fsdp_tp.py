"""FSDP x tensor parallelism on 4 x 2 devices: the tiny Qwen 3 (q/k norms, head_dim
64 over dim 256).

    python train.py --config=configs/qwen3_fsdp_tp.py
    ndjax plan --config=configs/qwen3_fsdp_tp.py --devices=64 \\
        --config.model.preset=qwen3_8b
    python train.py --config=configs/qwen3_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (its config.json sets the model).
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "qwen3"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
