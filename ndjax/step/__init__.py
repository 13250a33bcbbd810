"""What one train step computes: the train state and its optimizer (``state``), the
dtypes of parameters and compute (``precision``), the jitted step (``train_step``) and
the library's way in for a model of your own (``shard``: ``shard_model``,
``make_train_step``)."""
