"""Backward costs as tables and sentences: what the training log and
``tools/analyze_cost.py`` print.

The numbers come from the cost model (:mod:`.cost`, :mod:`.model_cost`);
this module only lays them out, through the shared :func:`format_table`.
Kept apart from the counting so that the hook and the tool print the same
counts in their own layouts without either owning the other's.
"""
import math
from typing import Any, Dict, List, Optional, Sequence

from torch import nn

from .cost import conv_backward_cost
from .model_cost import ModelCost
from .table import format_table

__all__ = [
    'fmt_flops', 'fmt_bytes', 'format_cost_table', 'model_cost_table',
    'cost_summary_lines', 'measured_memory_table'
]


def fmt_flops(v: float) -> str:
    """FLOPs with a G/M/K prefix and three decimals (the tool's table)."""
    for unit, scale in (('G', 1e9), ('M', 1e6), ('K', 1e3)):
        if abs(v) >= scale:
            return f'{v / scale:.3f}{unit}'
    return f'{v:.0f}'


def fmt_bytes(v: float) -> str:
    """Bytes in GiB/MiB/KiB with two decimals (the tool's table)."""
    for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
        if abs(v) >= scale:
            return f'{v / scale:.2f}{unit}'
    return f'{v:.0f}B'


def _log_flops(v: float) -> str:
    """The training log's short form: G above 1e9, else M."""
    if v >= 1e9:
        return f'{v / 1e9:.2f}G'
    return f'{v / 1e6:.2f}M'


def _log_mib(v: float) -> str:
    return f'{v / 2**20:.2f}MiB'


def format_cost_table(model: nn.Module,
                      choices: Sequence[Any],
                      batch: int = 1,
                      mode: str = 'gf',
                      needs_input_grad: Optional[Dict[str, bool]] = None
                      ) -> str:
    """The GradFilterHook's table of the chosen layers and their backward
    costs, logged at the start of training.

    Args:
        model: the (unwrapped) segmentor, for trainable-parameter counts.
        choices: the applied layers
            (:class:`~mmseg_gf.engine.selection.LayerChoice`).
        batch: training batch size.
        mode: 'gf' or 'vanilla' (shown in the title).
        needs_input_grad: path -> whether the layer computes ``g_x`` (its
            input depends on a trained layer), e.g. from
            ``trace_convs(model, size, grad=True)``. Default: every layer
            but the first in execution order (an upper bound: branches fed
            by frozen features need no ``g_x``).
    """
    header = ('path', 'k/s/d/g', 'in->out', 'r', 'params', 'bwd vanilla',
              'bwd GF', 'saved vanilla', 'saved GF')
    rows: List[Sequence[str]] = []
    tot = [0, 0, 0, 0]
    for i, c in enumerate(choices):
        cost = conv_backward_cost(
            cin=c.in_shape[0], cout=c.out_shape[0], kh=c.kernel_size[0],
            kw=c.kernel_size[1], stride=c.stride, dilation=c.dilation,
            groups=c.groups, in_hw=c.in_shape[1:], out_hw=c.out_shape[1:],
            batch=batch, radius=c.radius,
            need_input_grad=(needs_input_grad[c.path] if needs_input_grad
                             and c.path in needs_input_grad else i > 0))
        params = sum(p.numel() for p in c.module.parameters()
                     if p.requires_grad)
        tot[0] += cost.vanilla_flops
        tot[1] += cost.gf_flops
        tot[2] += cost.vanilla_saved_bytes
        tot[3] += cost.gf_saved_bytes
        rows.append((
            c.path, f'{c.kernel_size[0]}/{c.stride[0]}/{c.dilation[0]}'
            f'/{c.groups}', f'{c.in_shape[1]}x{c.in_shape[2]}->'
            f'{c.out_shape[1]}x{c.out_shape[2]}', str(c.radius), str(params),
            _log_flops(cost.vanilla_flops), _log_flops(cost.gf_flops),
            _log_mib(cost.vanilla_saved_bytes),
            _log_mib(cost.gf_saved_bytes)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows.append(('total (+classifier/norm params)', '', '', '',
                 str(trainable), _log_flops(tot[0]), _log_flops(tot[1]),
                 _log_mib(tot[2]), _log_mib(tot[3])))
    title = (f'Gradient filter ({mode}): {len(choices)} layers, batch '
             f'{batch}, backward FLOPs / saved activations of the chosen '
             'convs')
    return title + '\n' + format_table(header, rows, style='text',
                                       rule=False)


def model_cost_table(cost: ModelCost) -> str:
    """Every counted conv of a :class:`ModelCost` with its geometry and its
    vanilla / GF FLOPs, MACs and saved bytes, then the totals."""
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
    return format_table(header, rows, style='text')


def cost_summary_lines(cost: ModelCost) -> List[str]:
    """What the totals of a :class:`ModelCost` mean, in sentences: the
    mode, the convention, the GF savings, what was not counted."""
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


def measured_memory_table(result: Dict[str, Any]) -> str:
    """:func:`~mmseg_gf.analysis.model_cost.measure_memory`'s result: the
    measured and analytic saved bytes per trained conv, then the whole
    forward's saved bytes and the step's peak per mode."""
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
    lines = [format_table(header, rows, style='text')]
    for m in modes:
        lines.append(
            f'{m}: everything the forward saves for backward '
            f'{fmt_bytes(result[m]["saved_bytes_total"])}; peak of one '
            f'training step (forward + backward, above the memory before '
            f'it) {fmt_bytes(result[m]["peak_bytes"])}')
    return '\n'.join(lines)
