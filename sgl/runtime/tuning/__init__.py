"""Kernels and paths chosen by measurement, per host: which attention backend runs prefill,
whether bf16 CPU matmuls run as bf16 or fp32 GEMMs, how many rows the C decode step
takes and on how many threads. `calibrate.choose_paths` times the candidates on the
model's real shapes at the first start on a machine (measure.py), caches the answer as
JSON keyed by the CPU, the kernel build, torch and the model's shapes (cache.py), and
lets explicit flags override any item; the result is a plain `PathChoice` (choice.py)
that the worker build applies.
"""
