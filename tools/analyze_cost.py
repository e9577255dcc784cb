"""Backward cost of a config's trained layers: FLOPs, MACs, saved bytes.

mmseg's ``tools/analysis_tools/get_flops.py`` CLI, for the backward pass of
what a gradient-filter config trains. The config's ``gradient_filter``
setting is applied (``rewrite_config``), the model is traced at ``--shape``
and every trained conv is listed in execution order with its geometry,
radius, and the backward FLOPs / MACs and saved activation bytes of the
exact (vanilla) and the gradient-filtered backward, all from the shared
cost model (``mmseg_gf.analysis.cost.conv_backward_cost``; conventions in
docs/cost.md). A config without ``gradient_filter`` is "Vanilla BP All":
every conv on the inference path (GF columns then at ``--radius``).

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
"""
import argparse
import math
import os.path as osp
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from mmengine.config import Config, DictAction

import mmseg_gf  # noqa: F401  (registers GFConv2d, GradFilterModel, ...)
from mmseg_gf.analysis.model_cost import (ModelCost, build_segmentor,
                                          measure_memory,
                                          model_backward_cost)
from mmseg_gf.analysis.step_memory import trace_step_saved_bytes
from mmseg_gf.engine.cli import markdown_table, write_json
from mmseg_gf.engine.selection import trace_convs

# ----------------------------------------------------------------------------
# The paper's Table 3 (Cityscapes-pretrained, finetuned on VOC12Aug, 512x512
# crops; ResNet-18 models): the GFLOPs column. Rows: Vanilla BP All / 5 / 10,
# Ours 5 / 10.
PAPER_TABLE3 = {
    'pspnet_r18': dict(label='PSPNet-R18', all=166.5, vanilla={5: 15.0,
                                                               10: 110.6},
                       gf={5: 0.14, 10: 0.79}),
    'deeplabv3_r18': dict(label='DLV3-R18', all=151.2, vanilla={5: 18.0,
                                                                10: 102.0},
                          gf={5: 0.31, 10: 2.96}),
    'fcn_r18': dict(label='FCN-R18', all=170.3, vanilla={5: 59.5, 10: 100.9},
                    gf={5: 0.58, 10: 0.96}),
    'upernet_r18': dict(label='UPerNet-R18', all=541.0,
                        vanilla={5: 503.9, 10: 507.6},
                        gf={5: 1.97, 10: 2.22}),
}

# The layers of each row. Where the public reference implementation has a
# list (configs/_base_/strategies/reference/*), it is used as is; the other
# 5-layer rows are the part of the reference's 10-layer list (same radii)
# that the paper's "Ours 5" GFLOPs point to (docs/cost.md):
#   DLV3 5L: the ASPP branches and the bottleneck (r = 3/3/6/9, 3);
#   FCN 5L: the last 5 convs, r = 4 (the reference's 10L uses r = 2);
#   UPerNet 5L: lateral_convs.2, fpn_convs.0/1/2, fpn_bottleneck.
PAPER_LAYERS: Dict[str, Dict[int, Any]] = {
    'pspnet_r18': {5: 'gf_ref5', 10: 'gf_ref10'},
    'deeplabv3_r18': {
        5: ('gf_ref10', ['decode_head.aspp_modules',
                         'decode_head.bottleneck']),
        10: 'gf_ref10'
    },
    'fcn_r18': {5: 'gf_last5_r4', 10: 'gf_ref10'},
    'upernet_r18': {
        5: ('gf_ref10', ['decode_head.lateral_convs.2',
                         'decode_head.fpn_convs',
                         'decode_head.fpn_bottleneck']),
        10: 'gf_ref10'
    },
}
PAPER_SHAPE = (512, 512)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Backward FLOPs / MACs / saved bytes of the layers a '
        'config trains, exact vs gradient filter')
    parser.add_argument('config', nargs='?', help='config file path')
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
        '--models', nargs='+', choices=list(PAPER_TABLE3),
        default=list(PAPER_TABLE3), help='--paper-table3: which models')
    parser.add_argument(
        '--rows', nargs='+', choices=['all', '5', '10'],
        default=['all', '5', '10'], help='--paper-table3: which rows')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override some settings in the used config, the key-value '
        'pair in xxx=yyy format will be merged into config file.')
    args = parser.parse_args(argv)
    if not args.paper_table3 and not args.config:
        parser.error('give a config file, or --paper-table3')
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
    return args


# ----------------------------------------------------------------------------
# Formatting


def fmt_flops(v: float) -> str:
    for unit, scale in (('G', 1e9), ('M', 1e6), ('K', 1e3)):
        if abs(v) >= scale:
            return f'{v / scale:.3f}{unit}'
    return f'{v:.0f}'


def fmt_bytes(v: float) -> str:
    for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
        if abs(v) >= scale:
            return f'{v / scale:.2f}{unit}'
    return f'{v:.0f}B'


def text_table(header: Sequence[str], rows: List[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows)
              for i in range(len(header))]

    def line(r):
        return '  '.join(str(c).ljust(w) for c, w in zip(r, widths))

    return '\n'.join([line(header), line(['-' * w for w in widths])] +
                     [line(r) for r in rows])


def cost_table(cost: ModelCost) -> str:
    header = ('path', 'k/s/d/g', 'in -> out (CxHxW)', 'r', 'g_x',
              'FLOPs vanilla', 'FLOPs GF', 'MACs vanilla', 'MACs GF',
              'saved vanilla', 'saved GF')
    rows = []
    for layer in cost.layers:
        c = layer.cost
        rows.append((
            layer.path, f'{layer.kernel_size[0]}/{layer.stride[0]}/'
            f'{layer.dilation[0]}/{layer.groups}',
            '{}x{}x{} -> {}x{}x{}'.format(*layer.in_shape, *layer.out_shape),
            str(layer.radius), 'yes' if layer.need_input_grad else 'no',
            fmt_flops(c.vanilla_flops), fmt_flops(c.gf_flops),
            fmt_flops(layer.vanilla_macs), fmt_flops(layer.gf_macs),
            fmt_bytes(c.vanilla_saved_bytes), fmt_bytes(c.gf_saved_bytes)))
    t = cost.totals()
    rows.append((f'total ({len(cost.layers)} layers)', '', '', '', '',
                 fmt_flops(t['vanilla_flops']), fmt_flops(t['gf_flops']),
                 fmt_flops(t['vanilla_macs']), fmt_flops(t['gf_macs']),
                 fmt_bytes(t['vanilla_saved_bytes']),
                 fmt_bytes(t['gf_saved_bytes'])))
    return text_table(header, rows)


def summary_lines(cost: ModelCost) -> List[str]:
    t = cost.totals()
    speedup = (t['vanilla_flops'] / t['gf_flops']
               if t['gf_flops'] else math.inf)
    saving = (1 - t['gf_saved_bytes'] / t['vanilla_saved_bytes']
              if t['vanilla_saved_bytes'] else 0.0)
    if cost.mode == 'gf':
        what = 'gradient filter (trained with GF)'
    elif cost.mode == 'vanilla':
        what = ('exact backward (mode=vanilla; the GF columns: what the '
                'filter would cost on the same layers)')
    else:
        r = cost.layers[0].radius if cost.layers else '-'
        what = ('every inference-path conv, exact backward ("Vanilla BP '
                f'All"; the GF columns: hypothetical, r={r})')
    lines = [
        f'mode: {cost.mode}: {what}',
        f'input {cost.input_size[0]}x{cost.input_size[1]}, batch '
        f'{cost.batch}; FLOPs = 2 x MACs (+ the filter\'s additions), '
        'backward of the counted convs only',
        f'backward GFLOPs: vanilla {t["vanilla_flops"] / 1e9:.4f}, GF '
        f'{t["gf_flops"] / 1e9:.4f} ({speedup:.1f}x fewer); saved '
        f'activations: vanilla {fmt_bytes(t["vanilla_saved_bytes"])}, GF '
        f'{fmt_bytes(t["gf_saved_bytes"])} ({100 * saving:.1f}% less)',
        f'GF forward overhead (patch sums of x): '
        f'{fmt_flops(t["gf_forward_overhead_flops"])}FLOPs',
    ]
    if cost.collapse_dilated:
        lines.append('GF counted as the reference operator (dilated kernels '
                     'collapsed to one tap)')
    if cost.classifier is not None:
        c = cost.classifier
        lines.append(
            f'not counted: the classifier {c.path} (trained exactly by every '
            f'strategy): {fmt_flops(c.cost.vanilla_flops)}FLOPs backward')
    return lines


def measure_table(result: Dict[str, Any]) -> str:
    modes = [m for m in ('vanilla', 'gf') if m in result]
    header = ['path', 'r']
    for m in modes:
        header += [f'saved {m} measured', f'saved {m} analytic']
    rows = []
    first = result[modes[0]]['layers']
    for i, layer in enumerate(first):
        row = [layer['path'], str(layer['radius'])]
        for m in modes:
            x = result[m]['layers'][i]
            row += [fmt_bytes(x['measured']), fmt_bytes(x['analytic'])]
        rows.append(row)
    row = ['trained convs, total', '']
    for m in modes:
        row += [fmt_bytes(result[m]['trained_saved_bytes']),
                fmt_bytes(result[m]['analytic_saved_bytes'])]
    rows.append(row)
    lines = [text_table(header, rows)]
    for m in modes:
        lines.append(
            f'{m}: everything the forward saves for backward '
            f'{fmt_bytes(result[m]["saved_bytes_total"])}; peak of one '
            f'training step (forward + backward, above the memory before '
            f'it) {fmt_bytes(result[m]["peak_bytes"])}')
    return '\n'.join(lines)


# ----------------------------------------------------------------------------
# One config


def analyze(cfg: Config, shape: Sequence[int], batch: int = 1,
            radius: int = 4, collapse_dilated: bool = False) -> ModelCost:
    """Build the config's model (gradient_filter applied) and cost it."""
    model = build_segmentor(cfg, input_size=shape)
    return model_backward_cost(model, shape, batch=batch, radius=radius,
                               collapse_dilated=collapse_dilated)


def step_saved_bytes(cfg: Config, shape: Sequence[int]):
    """The whole step's analytic saved bytes of a lean gradient-filter
    config (:mod:`mmseg_gf.analysis.step_memory`), else None."""
    settings = cfg.get('gradient_filter')
    if not isinstance(settings, dict) or not settings.get('lean', True):
        return None
    return trace_step_saved_bytes(build_segmentor(cfg, input_size=shape),
                                  shape)


# ----------------------------------------------------------------------------
# The paper's Table 3


def paper_config(model: str, layers: int) -> Config:
    """The config of a Table 3 row (``layers``: 0 for "All", 5, 10)."""
    from mmseg_gf.pipeline import compose_config
    if layers == 0:
        return compose_config(model, 'voc', 'vanilla_all')
    spec = PAPER_LAYERS[model][layers]
    if isinstance(spec, str):
        return compose_config(model, 'voc', spec)
    strategy, paths = spec
    cfg = compose_config(model, 'voc', strategy)
    settings = dict(cfg.gradient_filter)
    settings['layers'] = list(paths)
    cfg.gradient_filter = settings
    return cfg


def fwd_bwd_macs(cost: ModelCost) -> int:
    """Forward + backward MACs of the counted convs: forward and ``g_W``
    have the same MACs, ``g_x`` where needed (the convention under which
    the paper's PSPNet / FCN vanilla numbers come closest)."""
    return sum(layer.cost.vanilla_grad_weight_flops +
               layer.cost.vanilla_grad_input_flops // 2
               for layer in cost.layers)


def paper_table3(models: Sequence[str], rows: Sequence[str] = ('all', '5',
                                                                '10'),
                 log=print) -> Dict[str, Any]:
    """Our GFLOPs for the Table 3 rows, next to the paper's.

    Per image at 512x512. For every row: the exact backward of the trained
    convs in our convention (2 FLOPs per MAC, ``g_x`` where needed + ``g_W``;
    ``vanilla``), forward + backward MACs of the same convs (``fwd_bwd``),
    the filtered backward with our operator (``gf``) and as the reference
    operator counts it, dilated kernels collapsed (``gf_ref_op``).
    """
    results = []
    for model in models:
        paper = PAPER_TABLE3[model]
        for row in rows:
            n = 0 if row == 'all' else int(row)
            t0 = time.time()
            cfg = paper_config(model, n)
            # Layer selection does not depend on the size: select at a small
            # one, cost at the paper's.
            net = build_segmentor(cfg, input_size=(64, 64))
            records = trace_convs(net, PAPER_SHAPE, grad=True)
            ours = model_backward_cost(net, PAPER_SHAPE, records=records)
            ref_op = model_backward_cost(net, PAPER_SHAPE, records=records,
                                         collapse_dilated=True)
            entry = dict(
                model=model, label=paper['label'],
                layers='All' if n == 0 else n,
                num_convs=len(ours.layers),
                paths=[layer.path for layer in ours.layers] if n else None,
                radii=[layer.radius for layer in ours.layers] if n else None,
                vanilla=ours.vanilla_flops / 1e9,
                fwd_bwd=fwd_bwd_macs(ours) / 1e9,
                paper_vanilla=paper['all'] if n == 0 else
                paper['vanilla'][n])
            if n:
                entry.update(gf=ours.gf_flops / 1e9,
                             gf_ref_op=ref_op.gf_flops / 1e9,
                             paper_gf=paper['gf'][n])
            results.append(entry)
            log(f'[paper-table3] {paper["label"]} {entry["layers"]}: '
                f'{time.time() - t0:.1f}s', file=sys.stderr)
    return dict(input_size=list(PAPER_SHAPE), batch=1, rows=results)


def _ratio(a: float, b: float) -> str:
    return f'{a / b:.2f}' if b else '-'


def paper_table3_markdown(result: Dict[str, Any]) -> str:
    header = ('model', '#L', 'convs', 'vanilla ours', 'vanilla paper',
              'paper/ours', 'fwd+bwd GMAC', 'paper/fwd+bwd', 'GF ours',
              'GF ref-op', 'GF paper', 'paper/ref-op')
    rows = []
    for e in result['rows']:
        gf = ('gf' in e)
        rows.append((
            e['label'], e['layers'], e['num_convs'], f'{e["vanilla"]:.1f}',
            f'{e["paper_vanilla"]:.1f}',
            _ratio(e['paper_vanilla'], e['vanilla']), f'{e["fwd_bwd"]:.1f}',
            _ratio(e['paper_vanilla'], e['fwd_bwd']),
            f'{e["gf"]:.3f}' if gf else '-',
            f'{e["gf_ref_op"]:.3f}' if gf else '-',
            f'{e["paper_gf"]:.2f}' if gf else '-',
            _ratio(e['paper_gf'], e['gf_ref_op']) if gf else '-'))
    return markdown_table(header, rows)


# ----------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    out: Dict[str, Any] = {}
    if args.paper_table3:
        result = paper_table3(args.models, args.rows)
        print('Backward GFLOPs per image at 512x512: ours vs the paper\'s '
              'Table 3 (GFLOPs column)')
        print(paper_table3_markdown(result))
        print('vanilla ours: exact backward of the trained convs, 2 FLOPs '
              'per MAC, g_x where needed + g_W; fwd+bwd: forward + backward '
              'MACs of the same convs; GF ours: our operator; GF ref-op: '
              'the reference operator (dilated kernels collapsed). See '
              'docs/cost.md.')
        out['paper_table3'] = result
    if args.config:
        cfg = Config.fromfile(args.config)
        if args.cfg_options:
            cfg.merge_from_dict(args.cfg_options)
        cost = analyze(cfg, args.shape, args.batch, args.radius,
                       args.collapse_dilated)
        print(f'config: {args.config}')
        print(cost_table(cost))
        for line in summary_lines(cost):
            print(line)
        out.update(config=args.config, cost=cost.as_dict())
        step = step_saved_bytes(cfg, args.shape)
        if step is not None:
            print(step.summary(args.batch))
            out['step_saved_bytes'] = dict(
                total=step.total(args.batch),
                by_category=step.by_category(args.batch),
                unmodelled=step.unmodelled)
        if args.measure:
            shape = args.measure_shape or args.shape
            result = measure_memory(cfg, shape, batch=args.batch,
                                    device=args.device,
                                    num_layers=args.measure_layers,
                                    radius=args.radius)
            print(f'\nmeasured at {shape[0]}x{shape[1]}, batch '
                  f'{args.batch}, {args.device} (saved: autograd\'s '
                  'saved_tensors_hooks; peak: ' +
                  ('max_memory_allocated' if args.device.startswith('cuda')
                   else 'torch profiler, live tensor bytes') + ')')
            print(measure_table(result))
            out['measured'] = result
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == '__main__':
    main()
