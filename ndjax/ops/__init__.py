"""Hand-written operations that the partitioner cannot derive from the model alone.

The contract of every kernel here (a library's, e.g. cuDNN's or jax's Mosaic GPU
ones, or our own), forward and every gradient: each row it returns is defined. A row
the kernel does not compute (past a grouped matmul's groups, a padding row) comes back
zero, and memory a kernel did not write never reaches a gradient or a collective:
zero it in the wrapper where the kernel leaves it. A kernel added here is tested
against a plain reference (ragged_dot, dense attention) in its interpreter where one
runs it, which fills unwritten memory with NaN (tests/test_grouped_matmul.py,
tests/test_attention.py); what no interpreter can run is named in its tests as
unchecked until a GPU runs bench/gpu.py.
"""
