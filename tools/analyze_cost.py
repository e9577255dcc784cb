"""Backward cost of a config's trained layers: FLOPs, MACs, saved bytes.

mmseg's ``tools/analysis_tools/get_flops.py`` CLI, for the backward pass of
what a gradient-filter config trains. The config's ``gradient_filter``
setting is applied (``rewrite_config``), the model is traced at ``--shape``
and every trained conv is listed in execution order with its geometry,
radius, and the backward FLOPs / MACs and saved activation bytes of the
exact (vanilla) and the gradient-filtered backward, all from the shared
cost model (``mmseg_gf.ops.conv_cost.conv_backward_cost``; conventions in
docs/cost.md). A config without ``gradient_filter`` takes the settings of a
``GradFilterHook`` in its ``custom_hooks``; with neither it is "Vanilla BP
All": every conv on the inference path, convs only (GF columns then at
``--radius``). The work is done by ``mmseg_gf.analysis.cost_cli``.
Any mmseg config works: ``--setting`` gives it a gradient-filter setting by
name, ``--offline`` builds a zoo config as it comes (SyncBN -> BN, no
pretrained checkpoint).

Examples::

    python tools/analyze_cost.py configs/gf/pspnet_r18_voc_r4.py
    python tools/analyze_cost.py configs/gf/upernet_r18_gf-ref10_1xb8-20k_voc12aug-512x512.py \
        --shape 512 1024 --batch 8 --out work_dirs/cost/upernet.json
    # measured too: autograd's saved bytes per trained conv and the peak
    # memory of one training step, GF vs vanilla on the same layers
    python tools/analyze_cost.py configs/gf/pspnet_r18_voc_r4.py \
        --measure --measure-shape 128 128
    # our GFLOPs next to the paper's Table 3 (512x512, per image)
    python tools/analyze_cost.py --paper-table3
    # every "last N at radius r": predicted backward GFLOPs, kept bytes and
    # step peak, marking what a budget allows (docs/budget.md)
    python tools/analyze_cost.py configs/gf/pspnet_r18_voc_r4.py --sweep \
        --batch 8 --budget saved_mib=60 peak_mib=600 --out work_dirs/cost/sweep.json
    # a family of mmseg's zoo by name: Swin-T UPerNet, GF on its last 20
    # layers (convs, Linears and attentions) at r = 4
    python tools/analyze_cost.py --family swin_t --setting gf_last20_r4
    # a config of mmseg's zoo as it comes, GF on its last 10 layers at r = 4
    # ($MMSEG: mmseg's package directory, where it installs its configs)
    python tools/analyze_cost.py --offline --setting gf_last10_r4 \
        $MMSEG/.mim/configs/stdc/stdc1_4xb12-80k_cityscapes-512x1024.py
"""
import argparse
import os.path as osp
from typing import Any, Dict, List, Optional

from mmengine.config import DictAction

import mmseg_gf  # noqa: F401  (registers GFConv2d, GradFilterModel, ...)
from mmseg_gf.analysis.cost_cli import load_config, report_config, sweep
from mmseg_gf.analysis.step_benchmark import row_settings
from mmseg_gf.protocol.paper_table3 import (PAPER_TABLE3_GFLOPS, TABLE3_NOTE,
                                            compare_with_table3,
                                            table3_comparison_table)
from mmseg_gf.engine.tool_args import write_json
from mmseg_gf.engine.zoo import ZOO_FAMILIES


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Backward FLOPs / MACs / saved bytes of the layers a '
        'config trains, exact vs gradient filter')
    parser.add_argument('config', nargs='?', help='config file path')
    parser.add_argument(
        '--family', choices=sorted(ZOO_FAMILIES),
        help="a family of mmseg's zoo by name instead of a config file "
        '(mmseg_gf/engine/zoo.py: the real-time and transformer '
        'families), built as with --offline')
    parser.add_argument('--shape', type=int, nargs='+', default=[512, 512],
                        help='input image size: H [W] (default 512 512)')
    parser.add_argument('--batch', type=int, default=1,
                        help='images per step the counts are for '
                        '(default 1: per image, as the paper)')
    parser.add_argument(
        '--radius', type=int, default=4,
        help='patch size of the GF columns for a config without '
        'gradient_filter (default 4)')
    parser.add_argument(
        '--collapse-dilated', action='store_true',
        help='count the GF backward of dilated convs as the public '
        'reference operator does (kernel summed to one tap) instead of '
        "this plugin's operator (taps kept on the pooled grid)")
    parser.add_argument('--out', help='write the numbers to this json file')
    parser.add_argument(
        '--measure', action='store_true',
        help='also measure, GF vs vanilla on the same layers: the bytes '
        'autograd saves per trained conv and the peak memory of one '
        'training step')
    parser.add_argument('--measure-shape', type=int, nargs='+', default=None,
                        help='H [W] of the measured step (default --shape)')
    parser.add_argument('--measure-layers', type=int, default=5,
                        help='N for --measure on a config without '
                        'gradient_filter: its last N convs (default 5)')
    parser.add_argument('--device', default='cpu',
                        help='device of the measured step (cpu, cuda)')
    parser.add_argument(
        '--paper-table3', action='store_true',
        help="our GFLOPs next to the paper's Table 3 (no config needed)")
    parser.add_argument(
        '--models', nargs='+', choices=list(PAPER_TABLE3_GFLOPS),
        default=list(PAPER_TABLE3_GFLOPS), help='--paper-table3: which models')
    parser.add_argument(
        '--rows', nargs='+', choices=['all', '5', '10'],
        default=['all', '5', '10'], help='--paper-table3: which rows')
    parser.add_argument(
        '--sweep', action='store_true',
        help='for N = 1 .. all and each radius: predicted backward GFLOPs '
        'per image, bytes kept for backward and step peak at --shape and '
        '--batch (a plot next to --out)')
    parser.add_argument(
        '--budget', nargs='+', action=DictAction,
        help='--sweep: limits to mark and choose by, e.g. saved_mib=60 '
        'peak_mib=600 backward_gflops=1 radii=[2,4,8] (default: the '
        "config's gradient_filter budget)")
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override some settings in the used config, the key-value '
        'pair in xxx=yyy format will be merged into config file.')
    parser.add_argument(
        '--setting', help="the config's gradient_filter by name, as "
        "tools/benchmark_step.py's rows: vanilla_last<N>, gf_last<N>_r<R>, "
        'gf_last<N>_auto (optionally :lean / :plain); vanilla_all: none. '
        "Default: the config's gradient_filter, else its GradFilterHook's "
        'settings')
    parser.add_argument(
        '--offline', action='store_true',
        help='adapt a config of mmseg\'s zoo for one process without '
        'downloads: SyncBN -> BN, pretrained / init_cfg checkpoints removed')
    args = parser.parse_args(argv)
    if args.family is not None:
        if args.config:
            parser.error('give a config file or --family, not both')
        args.config, args.offline = ZOO_FAMILIES[args.family].path, True
    if not args.paper_table3 and not args.config:
        parser.error('give a config file, --family, or --paper-table3')
    if args.config and not osp.isfile(args.config):
        parser.error(f'config: file {args.config!r} does not exist')
    for name in ('shape', 'measure_shape'):
        value = getattr(args, name)
        if value is None:
            continue
        if len(value) == 1:
            value = [value[0], value[0]]
        if len(value) != 2 or min(value) < 1:
            parser.error(f'--{name.replace("_", "-")}: H [W], positive')
        setattr(args, name, value)
    if args.batch < 1:
        parser.error('--batch must be >= 1')
    if (args.sweep or args.budget) and not args.config:
        parser.error('--sweep / --budget need a config file')
    if args.setting is not None:
        if args.setting == 'inference':
            parser.error("--setting: a gradient-filter setting "
                         "(vanilla_all, vanilla_last<N>, gf_last<N>_r<R>, "
                         "gf_last<N>_auto), not 'inference'")
        try:
            row_settings(args.setting)
        except ValueError as e:
            parser.error(f'--setting: {e}')
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    out: Dict[str, Any] = {}
    if args.paper_table3:
        result = compare_with_table3(args.models, args.rows)
        print('Backward GFLOPs per image at 512x512: ours vs the paper\'s '
              'Table 3 (GFLOPs column)')
        print(table3_comparison_table(result))
        print(TABLE3_NOTE)
        out['paper_table3'] = result
    if args.config:
        cfg = load_config(args)
        out.update(report_config(cfg, args))
        if args.sweep or args.budget:
            out['sweep'] = sweep(cfg, args)
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == '__main__':
    main()
