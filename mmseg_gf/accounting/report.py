"""The training log's table of the chosen layers and their costs.

:class:`~mmseg_gf.engine.hooks.GradFilterHook` logs it at the start of
training; ``tools/analyze_cost.py`` prints its own wider table
(:mod:`mmseg_gf.analysis.cost_report`) from the same cost model.
"""
from typing import Any, Dict, List, Optional, Sequence

from torch import nn

from ..models.layer_kinds import CONV2D, layers_noun

from .format import fmt_flops_short, fmt_mib, format_table
from .kept import StepSavedBytes

__all__ = ['chosen_layers_table', 'step_kept_table']


def _log_mib(v: float) -> str:
    return fmt_mib(v, 2, 'MiB')


def chosen_layers_table(model: nn.Module,
                        choices: Sequence[Any],
                        batch: int = 1,
                        mode: str = 'gf',
                        needs_input_grad: Optional[Dict[str, bool]] = None
                        ) -> str:
    """The chosen layers with their geometry and backward costs.

    Args:
        model: the (unwrapped) segmentor, for trainable-parameter counts.
        choices: the applied layers (anything with ``path``, ``module``,
            ``radius``, ``in_shape``, ``out_shape`` and ``geometry``, a
            :class:`~mmseg_gf.models.layer_kinds.LayerGeometry`, as
            :class:`~mmseg_gf.engine.selection.LayerChoice`).
        batch: training batch size.
        mode: 'gf' or 'vanilla' (shown in the title).
        needs_input_grad: path -> whether the layer computes ``g_x`` (its
            input depends on a trained layer). Default: every layer but the
            first in execution order (an upper bound: branches fed by
            frozen features need no ``g_x``).
    """
    header = ('path', 'k/s/d/g', 'in->out', 'r', 'params', 'bwd vanilla',
              'bwd GF', 'saved vanilla', 'saved GF')
    rows: List[Sequence[str]] = []
    tot = [0, 0, 0, 0]
    needs = needs_input_grad or {}
    for i, c in enumerate(choices):
        cost = c.geometry.cost(c.radius, batch=batch,
                               need_input_grad=needs.get(c.path, i > 0))
        params = sum(p.numel() for p in c.module.parameters()
                     if p.requires_grad)
        tot[0] += cost.vanilla_flops
        tot[1] += cost.gf_flops
        tot[2] += cost.vanilla_saved_bytes
        tot[3] += cost.gf_saved_bytes
        rows.append((
            c.path, c.geometry.describe(),
            f'{c.in_shape[1]}x{c.in_shape[2]}->'
            f'{c.out_shape[1]}x{c.out_shape[2]}', str(c.radius), str(params),
            fmt_flops_short(cost.vanilla_flops),
            fmt_flops_short(cost.gf_flops),
            _log_mib(cost.vanilla_saved_bytes),
            _log_mib(cost.gf_saved_bytes)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows.append(('total (+classifier/norm params)', '', '', '',
                 str(trainable), fmt_flops_short(tot[0]),
                 fmt_flops_short(tot[1]), _log_mib(tot[2]),
                 _log_mib(tot[3])))
    noun = layers_noun(getattr(c, 'kind', CONV2D.name) for c in choices)
    title = (f'Gradient filter ({mode}): {len(choices)} layers, batch '
             f'{batch}, backward FLOPs / saved activations of the chosen '
             f'{noun}')
    return title + '\n' + format_table(header, rows, style='text',
                                       rule=False)


def step_kept_table(step: StepSavedBytes, batch: int = 1) -> str:
    """What the whole step keeps for backward, by category, then each kind
    no rule covers with its measured bytes (``unmodelled: GELU``, ...;
    at ``batch``), never as zero."""
    rows = [(name, _log_mib(v), 'rule')
            for name, v in step.by_category(batch).items()
            if v and name != 'unmodelled']
    rows += [(f'unmodelled: {kind}', _log_mib(v), 'measured')
             for kind, v in step.unmodelled_bytes(batch).items()]
    rows.append(('total', _log_mib(step.total(batch)), ''))
    title = f'Kept for backward by the whole step, batch {batch}'
    return title + '\n' + format_table(('what', 'kept', 'how'), rows,
                                        align='lrl', style='text',
                                        rule=False)
