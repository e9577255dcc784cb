"""Check the project on one CUDA GPU in one command (about 10 minutes).

Runs, each in its own process, within a time budget
(:mod:`mmseg_gf.analysis.gpu_check` lists the stages and their shares):
the CUDA tests (``pytest -m cuda``), the step benchmark of the four models
at 512x512, batch 8, the kernels one step launches (recorded, next to the
CPU's count), PSPNet-R18's step compiled with CUDA graphs
(``torch.compile(mode='reduce-overhead')``) and the layer benchmark (the
paper's convs and the transformer Linears against cuDNN / cuBLAS). Then it
writes 8 files to ``--out-dir``: ``summary.md`` (the stack, each stage's
outcome, every target with what was measured), ``gpu_check.log`` (every
command and its whole output), and ``layers``, ``steps`` and ``launches``
as ``.json`` and ``.md``. Without a CUDA GPU it says so and exits at once
with status 3, writing nothing.

Examples::

    make gpu-check OUT=work_dirs/gpu_check
    python tools/gpu_check.py --out-dir work_dirs/gpu_check
    python tools/gpu_check.py --dry-run               # the commands only
    python tools/gpu_check.py --device cpu --quick --out-dir /tmp/gc
                                                      # the plumbing, on CPU

Exit status: 0 when every stage ran to its end (targets may still be
missed: see ``summary.md``), 1 when a stage failed or ran out of time, 3
without CUDA.
"""
import argparse
import os
import os.path as osp
import shutil
import sys
import tempfile
from typing import List, Optional

import torch

from mmseg_gf.analysis.gpu_check import (Runner, check_commands,
                                         environment, run_stages,
                                         stage_commands, write_results)

NO_CUDA_STATUS = 3


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out-dir', default='work_dirs/gpu_check')
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'],
                   help="'cpu' runs the same stages on the CPU (with "
                   "--quick: tiny settings), to try the command itself")
    p.add_argument('--quick', action='store_true',
                   help='tiny settings: a few tests, one small layer at '
                   'batch 1, one model of each step run at 64x64')
    p.add_argument('--dry-run', action='store_true',
                   help='print the commands (their arguments checked by '
                   'the tools\' own parsers) and run nothing')
    p.add_argument('--budget-s', type=float, default=600.0,
                   help='seconds for all stages together (default 600; '
                   'each stage has its share, '
                   'mmseg_gf.analysis.gpu_check.STAGES)')
    p.add_argument('--test-workers', type=int, default=8,
                   help='pytest-xdist workers for the CUDA tests, tests '
                   'spread one by one (0: one process)')
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        print(f'gpu-check: no CUDA GPU is available (torch '
              f'{torch.__version__}, torch.cuda.is_available() is False); '
              'nothing was run. On a CPU-only machine, try the command '
              'itself with --device cpu --quick.', file=sys.stderr)
        return NO_CUDA_STATUS
    args.work = tempfile.mkdtemp(prefix='gpu_check_')
    try:
        commands = stage_commands(args)
        check_commands(commands)
        if args.dry_run:
            for stage, items in commands.items():
                for command in items:
                    print(f'[{stage}] {" ".join(command["argv"])}')
            return 0
        return _run(args, commands)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


def _run(args, commands) -> int:
    log_path = osp.join(args.out_dir, 'gpu_check.log')
    env = environment(args.device)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(log_path, 'w') as log:
        log.write('gpu-check\n' + ''.join(f'{k}: {v}\n'
                                          for k, v in env.items()))
    print('[gpu-check] ' + ', '.join(f'{k} {v}' for k, v in env.items()),
          flush=True)
    runner = Runner(log_path, args.budget_s)
    ok = run_stages(runner, commands, args.budget_s)
    written = write_results(args.out_dir, commands, runner, env)
    print(f'[gpu-check] wrote {", ".join(sorted(written + [log_path]))}')
    with open(osp.join(args.out_dir, 'summary.md')) as f:
        print(f.read())
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
