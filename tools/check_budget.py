"""The budget's predictions next to measurements on mmseg's real-time
families and the paper protocol's models.

For each model (a family: mmseg 1.2.2's zoo config, offline: SyncBN -> BN;
a protocol model: its config composed from configs/_base_; random weights)
at ``--shape``, ``--batch`` and ``--radius``, for its last ``--last`` convs
(one or more N) and for all of them (unless ``--no-all-convs``): the kept
bytes and the step peak that ``profile_segmentor(model, shape,
timeline=True).cost(N, radius, batch)`` predicts, and those of the model
built with that setting (autograd's saved bytes, the profiler's live bytes
of one step); see
:func:`mmseg_gf.analysis.budget_sweep.config_predicted_vs_measured`.
Prints the markdown tables of docs/budget.md.

Examples::

    python tools/check_budget.py --families all --shape 128 128 --batch 2 \
        --radius 4 --last 10 --out work_dirs/budget/families.json
    python tools/check_budget.py --models all --shape 512 512 --batch 8 \
        --last 5 10 --no-all-convs --out work_dirs/budget/protocol.json
"""
import argparse
from typing import List, Optional

import torch

import mmseg_gf  # noqa: F401  (registers the plugin's modules)
from mmseg_gf.analysis.budget_sweep import (config_predicted_vs_measured,
                                            families_markdown,
                                            family_predicted_vs_measured)
from mmseg_gf.analysis.hardware import cpu_model
from mmseg_gf.engine.tool_args import write_json
from mmseg_gf.engine.zoo import REALTIME_FAMILIES
from mmseg_gf.protocol import PROTOCOL_MODELS
from mmseg_gf.protocol.experiments import step_row_config


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--families', nargs='+', default=None,
                   choices=sorted(REALTIME_FAMILIES) + ['all'],
                   help="'all': every family that runs at --shape (the "
                   'default when no --models are given)')
    p.add_argument('--models', nargs='+', default=[],
                   choices=sorted(PROTOCOL_MODELS) + ['all'],
                   help="the paper protocol's models ('all': the six)")
    p.add_argument('--dataset', default='voc',
                   help='--models: target dataset of the configs (classes)')
    p.add_argument('--shape', type=int, nargs=2, default=[128, 128],
                   metavar=('H', 'W'))
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--radius', type=int, default=4)
    p.add_argument('--last', type=int, nargs='+', default=[10],
                   help='N of the "last N convs" rows (default 10)')
    p.add_argument('--no-all-convs', dest='all_convs', action='store_false',
                   help='leave out the row training every conv')
    p.add_argument('--threads', type=int, default=None,
                   help='torch intra-op threads (default: torch\'s)')
    p.add_argument('--out', help='write the numbers to this json file')
    args = p.parse_args(argv)
    if args.families is None:
        args.families = [] if args.models else ['all']
    if 'all' in args.families:
        side = min(args.shape)
        args.families = [n for n, f in REALTIME_FAMILIES.items()
                         if f.min_crop <= side]
    if 'all' in args.models:
        args.models = list(PROTOCOL_MODELS)
    if any(n < 1 for n in args.last):
        p.error(f'--last: N >= 1, got {args.last}')
    return args


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = list(args.last) + ([None] if args.all_convs else [])
    results = []
    for name in args.families:
        results.append(family_predicted_vs_measured(
            name, args.shape, args.batch, args.radius, settings))
        print(families_markdown(results[-1:]).splitlines()[-1], flush=True)
    for name in args.models:
        cfg = step_row_config(name, args.dataset, 'inference', args.shape)
        results.append(dict(model=name, **config_predicted_vs_measured(
            cfg, PROTOCOL_MODELS[name].label, args.shape, args.batch,
            args.radius, settings)))
        print(families_markdown(results[-1:]).splitlines()[-1], flush=True)
    print(f'\n{args.shape[0]}x{args.shape[1]}, batch {args.batch}, r = '
          f'{args.radius}; kept / peak, predicted / measured, MiB; '
          f'torch {torch.__version__}, {torch.get_num_threads()} threads, '
          f'{cpu_model()}')
    print(families_markdown(results))
    if args.out:
        write_json(args.out, dict(results=results, torch=torch.__version__,
                                  threads=torch.get_num_threads(),
                                  cpu=cpu_model()))
    return results


if __name__ == '__main__':
    main()
