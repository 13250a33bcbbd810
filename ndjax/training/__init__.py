"""The training loop (``loop.train``) and what it calls around each step: its hooks
(``hooks``), the metrics' writers (``sinks``), SIGTERM / Ctrl-C handling
(``stop_signals``), and what a run says before its first step and after its last
(``summary``, with ``report``'s table of where every parameter lives)."""
