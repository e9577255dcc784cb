"""Backward cost of a config's trained layers: FLOPs, MACs, saved bytes.

mmseg's ``tools/analysis_tools/get_flops.py`` CLI, for the backward pass of
what a gradient-filter config trains. The config's ``gradient_filter``
setting is applied (``rewrite_config``), the model is traced at ``--shape``
and every trained conv is listed in execution order with its geometry,
radius, and the backward FLOPs / MACs and saved activation bytes of the
exact (vanilla) and the gradient-filtered backward, all from the shared
cost model (``mmseg_gf.ops.conv.cost.conv_backward_cost``; conventions in
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
from typing import Any, Dict, List, Optional

import mmseg_gf  # noqa: F401  (registers GFConv2d, GradFilterModel, ...)
from mmseg_gf.analysis.cost_args import (add_measure_args, add_model_args,
                                         add_setting_args, check_cost_args)
from mmseg_gf.analysis.cost_cli import load_config, report_config, sweep
from mmseg_gf.protocol.paper_table3 import (PAPER_TABLE3_GFLOPS, TABLE3_NOTE,
                                            compare_with_table3,
                                            table3_comparison_table)
from mmseg_gf.engine.tool_args import write_json


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The config's flags and their checks are the package's
    (:mod:`mmseg_gf.analysis.cost_args`); the Table 3 flags are added
    here, their choices being the protocol's."""
    parser = argparse.ArgumentParser(
        description='Backward FLOPs / MACs / saved bytes of the layers a '
        'config trains, exact vs gradient filter')
    add_model_args(parser)
    add_measure_args(parser)
    parser.add_argument(
        '--paper-table3', action='store_true',
        help="our GFLOPs next to the paper's Table 3 (no config needed)")
    parser.add_argument(
        '--models', nargs='+', choices=list(PAPER_TABLE3_GFLOPS),
        default=list(PAPER_TABLE3_GFLOPS), help='--paper-table3: which models')
    parser.add_argument(
        '--rows', nargs='+', choices=['all', '5', '10'],
        default=['all', '5', '10'], help='--paper-table3: which rows')
    add_setting_args(parser)
    return check_cost_args(parser, parser.parse_args(argv))


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
