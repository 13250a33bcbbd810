"""The process around the program: one-line errors (``errors``), the console and the
libraries' chatter (``console``), absl flags and failures of the verbs (``cli``), child
processes (``children``), the CPU allocator set before jax starts (``cpu_malloc``), the
compilation cache (``xla_cache``) and the options every step is compiled with
(``compiler``). Nothing here imports the rest of ndjax."""
