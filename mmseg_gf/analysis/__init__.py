"""Measurements, benchmarks and reports built on the accounting and the
engine: per-model backward costs and their tables (``tools/analyze_cost.py``),
the budget sweep, step and layer benchmarks, measured memory and gradient
quality of whole models."""
