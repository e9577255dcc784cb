"""Time the bilinear GEMM resize's backward with and without keeping a
non-finite gradient value local (the choice ops.resize.gemm's docstring
states), against torch's kernel.

Example (the figures of docs/benchmarks/resize_nonfinite_cpu.md)::

    python tools/benchmark_resize_nonfinite.py --threads 1 --repeats 9 \
        --out docs/benchmarks/resize_nonfinite_cpu

Runs the GEMM route on the CPU as it runs on CUDA (``as_on_cuda``);
``--out PREFIX`` writes ``PREFIX.json`` and ``PREFIX.md``.
"""
import argparse

import torch

from mmseg_gf.analysis.resize_nonfinite import markdown, measure
from mmseg_gf.engine.tool_args import command_line, write_report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--repeats', type=int, default=9)
    parser.add_argument('--threads', type=int, default=None,
                        help='torch CPU threads (default: torch\'s choice)')
    parser.add_argument('--out', default=None,
                        help='write PREFIX.json and PREFIX.md')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.repeats)
    command = command_line('benchmark_resize_nonfinite', argv)
    table = markdown(rows, command)
    print(table)
    if args.out:
        write_report(args.out + '.json', dict(command=command, rows=rows),
                     '# Non-finite gradients through the GEMM resize: what '
                     'keeping them local costs\n\n' + table)


if __name__ == '__main__':
    main()
