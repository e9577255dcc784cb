"""The budget's predictions next to measurements on any mmseg config,
mmseg's real-time and transformer families and the paper protocol's models.

For each model (a CONFIG file, as mmseg's own tools take it: built plain,
its ``gradient_filter`` left out, ``--offline`` for a zoo config as it
comes; a family: mmseg 1.2.2's zoo config, offline: SyncBN -> BN; a
protocol model: its config composed from configs/_base_; random weights)
at ``--shape``, ``--batch`` and ``--radius``, for its last ``--last``
layers of ``--layer-kinds`` (one or more N; convs by default, ``all``:
every kind, the Linears and attentions of transformers too) and for all of
them (unless ``--no-all-convs``): the kept bytes and the step peak that
``profile_segmentor(model, shape, timeline=True, layer_kinds=...).cost(N,
radius, batch)`` predicts, and those of the model built with that setting
(autograd's saved bytes, the profiler's live bytes of one step); see
:func:`mmseg_gf.analysis.budget_sweep.config_predicted_vs_measured`.
Prints the markdown tables of docs/budget.md, one row per model; torch's
profiler runs with its own messages silenced (``--verbose`` keeps them).

Examples::

    python tools/check_budget.py --families all --shape 128 128 --batch 2 \
        --radius 4 --last 10 --out work_dirs/budget/families.json
    python tools/check_budget.py --families transformers --layer-kinds all \
        --shape 256 256 --batch 2 --last 10 20 --no-all-convs
    python tools/check_budget.py --models all --shape 512 512 --batch 8 \
        --last 5 10 --no-all-convs --out work_dirs/budget/protocol.json
    python tools/check_budget.py configs/gf/pspnet_r18_voc_r4.py \
        --shape 128 128 --last 5 10
    python tools/check_budget.py --offline --layer-kinds all \
        $MMSEG/.mim/configs/swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py
"""
import argparse
import os.path as osp
from typing import List, Optional

import torch

import mmseg_gf  # noqa: F401  (registers the plugin's modules)
from mmseg_gf.accounting.quiet import quiet_profiler
from mmseg_gf.analysis.budget_sweep import (config_predicted_vs_measured,
                                            families_markdown,
                                            family_predicted_vs_measured,
                                            file_predicted_vs_measured)
from mmseg_gf.analysis.hardware import cpu_model
from mmseg_gf.engine.tool_args import write_json
from mmseg_gf.engine.zoo import (REALTIME_FAMILIES, TRANSFORMER_FAMILIES,
                                 ZOO_FAMILIES)
from mmseg_gf.models.layer_kinds import CONV2D, kind_names
from mmseg_gf.protocol import PROTOCOL_MODELS
from mmseg_gf.protocol.run_config import step_row_config


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('configs', nargs='*', metavar='CONFIG',
                   help='mmseg config files (any; built plain)')
    p.add_argument('--offline', action='store_true',
                   help='CONFIGs: SyncBN -> BN, no pretrained checkpoint '
                   "(a zoo config as it comes)")
    p.add_argument('--families', nargs='+', default=None,
                   choices=sorted(ZOO_FAMILIES) + ['all', 'transformers'],
                   help="'all': every real-time family that runs at "
                   "--shape (the default when no CONFIG or --models are "
                   "given); 'transformers': Segformer-B0 and the "
                   'transformer families')
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
                   help='N of the "last N layers" rows (default 10)')
    p.add_argument('--layer-kinds', nargs='+', default=[CONV2D.name],
                   choices=list(kind_names()) + ['all'],
                   help="the kinds N counts (default conv2d, the paper's "
                   "count); 'all': every kind, as gradient_filter's "
                   'layer_kinds=None')
    p.add_argument('--no-all-convs', dest='all_convs', action='store_false',
                   help='leave out the row training every layer')
    p.add_argument('--threads', type=int, default=None,
                   help='torch intra-op threads (default: torch\'s)')
    p.add_argument('--verbose', action='store_true',
                   help="keep torch's profiler messages")
    p.add_argument('--out', help='write the numbers to this json file')
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Groups expanded; every bad setting refused before a model is built."""
    if args.families is None:
        args.families = [] if args.models or args.configs else ['all']
    if 'all' in args.families:
        side = min(args.shape)
        args.families = [n for n, f in REALTIME_FAMILIES.items()
                         if f.min_crop <= side]
    elif 'transformers' in args.families:
        args.families = ['segformer_b0', *TRANSFORMER_FAMILIES]
    if 'all' in args.models:
        args.models = list(PROTOCOL_MODELS)
    if any(n < 1 for n in args.last):
        p.error(f'--last: N >= 1, got {args.last}')
    for path in args.configs:
        if not osp.isfile(path):
            p.error(f'CONFIG: file {path!r} does not exist')
    args.layer_kinds = (None if 'all' in args.layer_kinds
                        else args.layer_kinds)


def _results(args) -> List[dict]:
    """One result per model, its table row printed as it comes."""
    settings = list(args.last) + ([None] if args.all_convs else [])
    common = dict(input_size=args.shape, batch=args.batch,
                  radius=args.radius, settings=settings,
                  layer_kinds=args.layer_kinds)
    results = []

    def run(measure, **kwargs):
        with quiet_profiler(not args.verbose):
            results.append(dict(kwargs, **measure()))
        print(families_markdown(results[-1:]).splitlines()[-1], flush=True)

    for path in args.configs:
        run(lambda: file_predicted_vs_measured(
            path, offline=args.offline, **common))
    for name in args.families:
        run(lambda: family_predicted_vs_measured(name, **common))
    for name in args.models:
        cfg = step_row_config(name, args.dataset, 'inference', args.shape)
        run(lambda: config_predicted_vs_measured(
            cfg, PROTOCOL_MODELS[name].label, **common), model=name)
    return results


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = _results(args)
    kinds = ('every kind' if args.layer_kinds is None else
             ', '.join(args.layer_kinds))
    print(f'\n{args.shape[0]}x{args.shape[1]}, batch {args.batch}, r = '
          f'{args.radius}, layers: {kinds}; kept / peak, predicted / '
          f'measured, MiB; torch {torch.__version__}, '
          f'{torch.get_num_threads()} threads, {cpu_model()}')
    print(families_markdown(results))
    if args.out:
        write_json(args.out, dict(results=results, torch=torch.__version__,
                                  threads=torch.get_num_threads(),
                                  cpu=cpu_model()))
    return results


if __name__ == '__main__':
    main()
