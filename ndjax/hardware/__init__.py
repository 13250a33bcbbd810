"""The GPUs a step is priced and compiled for, present or not: each kind's figures and the
roofline of a compiled step (``roofline``), a model's FLOPs per token and MFU (``flops``),
and XLA's GPU compiler run without a GPU (``gpu_target``); the CPU benchmarks report
(``host``)."""
