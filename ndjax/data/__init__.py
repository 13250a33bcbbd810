"""The data pipeline: documents -> tokens -> packed rows -> this process's share of each batch.

- ``sources``: the builtin corpus, local text / JSON Lines / Parquet files (also read as
  records, for chat data), token files
- ``tokenizers``: byte-level (the default) or a Hugging Face tokenizer.json
- ``chat``, ``chat_template``: conversations rendered with the tokenizer's chat template,
  and the mask of the assistant's tokens (``data.source=chat``)
- ``packing``: token windows -> the batch fields (segment ids, positions, loss mask)
- ``streams``: the rows of any global batch as a pure function of (data, seed, step, row)
- ``loader``: config -> checks -> a prefetching iterator with a resumable position
- ``preference``, ``prompts``: TRL's records: preference pairs and KTO's examples, and
  GRPO's prompts (``data.format=prompt``: ``streams.PromptRows``, whose batches are
  the prompts' ids, not the fields below)
- ``prepare``: ``ndjax prepare``, offline pre-tokenization
- ``synthetic``: a learnable Markov-chain source that needs no files (tests, layouts)

Every batch is a dict of int32 arrays ``(rows, train.seq_len)`` with the fields below
(``BATCH_FIELDS``); the batches of KTO's examples (``data.format=unpaired_preference``,
``streams.KTORows``) add ``KTO_FIELDS``.
"""

BATCH_FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
# Added by data.format=unpaired_preference only (KTO's examples, each its sequence then its
# KL sequence, as segments 2k+1 and 2k+2 of a row): ``desirable`` is 1 on every input
# position of a desirable example's two segments, 0 elsewhere (undesirable, padding).
KTO_FIELDS = ("desirable",)
