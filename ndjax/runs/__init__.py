"""A run on disk: its directory and saved config (``workdir``), the lock that keeps one
writer (``lock``), orbax checkpoints (``checkpoint``) and the faults injected into them
in tests (``checkpoint_faults``), and Hugging Face directories read and written
(``hf``)."""
