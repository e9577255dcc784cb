"""Measurements, benchmarks and reports built on the accounting and the
engine: per-model backward costs and their tables (``tools/analyze_cost.py``),
the budget sweep, step and layer benchmarks, the kernel launches of a step
on the CUDA path (``tools/count_launches.py``), measured memory and gradient
quality of whole models."""
