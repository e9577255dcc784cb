"""A soak run: a lean gradient-filter step trained for many iterations on
inputs of many sizes, resident memory recorded; is it flat, and are the
shape caches within their bounds?

Example (the figures of docs/benchmarks/soak_cpu.md)::

    python tools/soak.py --models pspnet_r18 segformer_b0 --iters 1000 \
        --shapes 50 --base 48 48 --threads 1 --out docs/benchmarks/soak_cpu

``pspnet_r18`` trains the demo's config (``--config``), ``segformer_b0``
mmseg's Segformer-B0 shrunk (:func:`mmseg_gf.analysis.soak.soak_config`).
Each step draws one of ``--shapes`` distinct input sizes around
``--base``; ``VmRSS`` is read every ``--interval`` steps. Exits 1 when a
run's memory grew more than 5% from its second quarter to its last, or a
shape cache holds more than its bound. ``--out PREFIX`` writes
``PREFIX.json`` and ``PREFIX.md``.
"""
import argparse
import sys

from mmengine.utils import ProgressBar

from mmseg_gf.analysis.soak import random_shapes, soak, soak_config, \
    soak_table
from mmseg_gf.engine.tool_args import command_line, write_report

MODELS = ('pspnet_r18', 'segformer_b0')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', nargs='+', choices=MODELS,
                        default=list(MODELS))
    parser.add_argument('--config', default='configs/demo/'
                        'pspnet_r18_voc_r4_cpu.py',
                        help='config file of pspnet_r18')
    parser.add_argument('--iters', type=int, default=1000)
    parser.add_argument('--shapes', type=int, default=50,
                        help='distinct input sizes')
    parser.add_argument('--base', type=int, nargs=2, default=[64, 64],
                        metavar=('H', 'W'),
                        help='sizes are this times 0.75-2 per side')
    parser.add_argument('--interval', type=int, default=10,
                        help='steps between VmRSS records')
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--threads', type=int, default=None,
                        help='torch CPU threads during the runs (default: '
                        'torch\'s choice; 1 on a shared CPU)')
    parser.add_argument('--out', default=None,
                        help='write PREFIX.json and PREFIX.md')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = random_shapes(args.shapes, args.base, seed=args.seed)
    results = {}
    for name in args.models:
        print(f'{name}: {args.iters} iterations over {len(shapes)} sizes')
        bar = ProgressBar(args.iters)
        results[name] = soak(soak_config(name, args.config), args.iters,
                             shapes, args.interval, args.batch, args.seed,
                             progress=bar.update, threads=args.threads)
        print()
    command = command_line('soak', argv)
    table = soak_table(results, command)
    print(table)
    if args.out:
        write_report(args.out + '.json',
                     dict(command=command, results=results),
                     f'# Soak: resident memory and shape caches over '
                     f'{args.iters} iterations\n\n{table}')
    failed = [n for n, r in results.items()
              if not r['flat'] or r['over_bound']]
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
