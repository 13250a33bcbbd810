"""FSDP x tensor parallelism (the default experiment): tiny Llama, 4 x 2 devices."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    # The README's first run, on the builtin corpus: rows of 128 bytes, so that
    # `ndjax generate --workdir=runs/llama_fsdp_tp` has room for a prompt and
    # 64 new tokens (generation's --max_len is the run's train.seq_len). The model stays
    # the preset's: the README and docs/ compile and plan this config with
    # --config.model.preset=llama3_8b and start it from checkpoints (model.init_from),
    # where dims set here would override theirs.
    c.train.seq_len = 128
    return c
