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
import json
import sys

import torch

from mmseg_gf.analysis.resize_nonfinite import markdown, measure


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
    command = 'python tools/benchmark_resize_nonfinite.py ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    table = markdown(rows, command)
    print(table)
    if args.out:
        with open(args.out + '.json', 'w') as f:
            json.dump(dict(command=command, rows=rows), f, indent=1)
        with open(args.out + '.md', 'w') as f:
            f.write('# Non-finite gradients through the GEMM resize: what '
                    'keeping them local costs\n\n' + table)


if __name__ == '__main__':
    main()
