"""Whole training steps of the protocol's strategies next to inference.

For each model, time the rows (inference and strategies, ``:lean`` /
``:plain``) on one random batch at the training crop and measure the step's
peak live bytes and the bytes kept for backward, all in one process; see
:mod:`mmseg_gf.analysis.step_benchmark`. Writes ``steps.json``,
``steps.md`` and ``steps.png`` to ``--out-dir``.

Example::

    python tools/benchmark_step.py --models pspnet_r18 fcn_r18 \
        --crop 512 512 --batch 8 --out-dir work_dirs/benchmarks/steps
"""
import argparse
import os
import os.path as osp
import platform
from typing import List, Optional

import torch

import mmseg_gf  # noqa: F401  (registers the plugin's modules)
from mmseg_gf.analysis.step_benchmark import (DEFAULT_ROWS, benchmark_model,
                                              plot, step_table)
from mmseg_gf.engine.tool_args import write_json
from mmseg_gf.protocol import PROTOCOL_MODELS
from mmseg_gf.protocol.experiments import step_row_config


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--models', nargs='+', default=['pspnet_r18'],
                   choices=sorted(PROTOCOL_MODELS))
    p.add_argument('--dataset', default='voc',
                   help='target dataset of the configs (class count)')
    p.add_argument('--rows', nargs='+', default=list(DEFAULT_ROWS),
                   help="'inference' and strategies, e.g. gf_last5_r4:lean")
    p.add_argument('--crop', type=int, nargs=2, default=(512, 512),
                   metavar=('H', 'W'))
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--repeats', type=int, default=2,
                   help='timed steps per row (median); 0: memory only')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--no-memory', dest='memory', action='store_false',
                   help='time the rows only (no peak / saved bytes)')
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--out-dir', default='work_dirs/benchmarks/steps')
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        rows = [(row, step_row_config(name, args.dataset, row, args.crop))
                for row in args.rows]
        result = benchmark_model(
            name, rows, args.crop, args.batch, args.repeats, args.warmup,
            args.memory,
            progress=lambda msg, name=name: print(f'[{name}] {msg}',
                                                  flush=True))
        result['cpu'] = platform.processor() or platform.machine()
        results.append(result)
        print(f'\n{PROTOCOL_MODELS[name].label}, crop '
              f'{args.crop[0]}x{args.crop[1]}, '
              f'batch {args.batch}, {result["threads"]} threads, torch '
              f'{result["torch"]}; median of {args.repeats} steps')
        print(step_table(result), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    write_json(osp.join(args.out_dir, 'steps.json'), results)
    with open(osp.join(args.out_dir, 'steps.md'), 'w') as f:
        for result in results:
            f.write(f"## {PROTOCOL_MODELS[result['model']].label}\n\n"
                    f'{step_table(result)}\n\n')
    plot(results, osp.join(args.out_dir, 'steps.png'))
    return results


if __name__ == '__main__':
    main()
