"""Backward costs as tables and sentences for ``tools/analyze_cost.py``."""
import math
from typing import Any, Dict, List

from ..accounting.format import fmt_bytes, fmt_flops, format_table
from ..models.layer_kinds import layers_noun
from .model_cost import ModelCost

__all__ = ['model_cost_table', 'cost_summary_lines', 'measured_memory_table']


def model_cost_table(cost: ModelCost) -> str:
    """Every counted layer with its geometry and vanilla / GF costs, then
    totals."""
    convs_only = layers_noun(layer.kind for layer in cost.layers) == 'convs'
    header = ('path', 'k/s/d/g' if convs_only else 'k/s/d/g or grid',
              'in -> out (CxHxW)', 'r', 'g_x',
              'FLOPs vanilla', 'FLOPs GF', 'MACs vanilla', 'MACs GF',
              'saved vanilla', 'saved GF')
    rows = []
    for layer in cost.layers:
        c = layer.cost
        rows.append((
            layer.path, layer.describe,
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
    return format_table(header, rows, style='text')


def cost_summary_lines(cost: ModelCost) -> List[str]:
    """What a :class:`ModelCost`'s totals mean, in sentences."""
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
        others = ', '.join(f'{n} {k}' for k, n in
                           sorted(cost.not_counted.items()))
        left_out = (f'; not counted: {others} layers' if others else
                    '; the model has no Linear or other conv kinds')
        what = ('every inference-path conv, exact backward ("Vanilla BP '
                f'All", convs only (nn.Conv2d){left_out}; the GF columns: '
                f'hypothetical, r={r})')
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


def measured_memory_table(result: Dict[str, Any]) -> str:
    """Measured and analytic saved bytes per trained conv, then totals per
    mode."""
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
    row = ['trained layers, total', '']
    for m in modes:
        row += [fmt_bytes(result[m]['trained_saved_bytes']),
                fmt_bytes(result[m]['analytic_saved_bytes'])]
    rows.append(row)
    lines = [format_table(header, rows, style='text')]
    for m in modes:
        lines.append(
            f'{m}: everything the forward saves for backward '
            f'{fmt_bytes(result[m]["saved_bytes_total"])}; peak of one '
            f'training step (forward + backward: what it allocates, the '
            f'gradients included) {fmt_bytes(result[m]["peak_bytes"])}')
    return '\n'.join(lines)
