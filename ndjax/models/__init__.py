"""The models, in logical axis names only: the decoder every family builds (``decoder``,
with ``layers``, ``moe``, ``lora`` and ``quant``), one module per family behind
``registry`` (``llama``, ``mistral``, ``qwen``, ``gemma``, ``mixtral``, ``qwen3_moe``,
``qwen2_moe``; the config.json fields they share: ``hf_config``), and generation with a
KV cache (``decode``, ``sampling``)."""
