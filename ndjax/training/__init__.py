"""The training loop (``loop.train``) and what it calls around each step: its hooks
(``hooks``), the metrics' writers (``sinks``) and SIGTERM / Ctrl-C handling
(``stop_signals``)."""
