"""Data sources. Each yields numpy batches with the fields of ``BATCH_FIELDS``."""

BATCH_FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
