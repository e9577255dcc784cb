"""The training log's table of the chosen layers and their costs.

:class:`~mmseg_gf.engine.hooks.GradFilterHook` logs it at the start of
training; ``tools/analyze_cost.py`` prints its own wider table
(:mod:`mmseg_gf.analysis.cost_report`) from the same cost model.
"""
from typing import Any, Dict, List, Optional, Sequence

from torch import nn

from ..models.layer_kinds import CONV2D, layers_noun
from ..models.layer_paths import layer_path, representative_input

from .format import fmt_flops_short, fmt_mib, format_table
from .kept import StepSavedBytes

__all__ = ['chosen_layers_table', 'step_kept_table']


def _log_mib(v: float) -> str:
    return fmt_mib(v, 2, 'MiB')


def chosen_layers_table(model: nn.Module,
                        choices: Sequence[Any],
                        batch: int = 1,
                        mode: str = 'gf',
                        needs_input_grad: Optional[Dict[str, bool]] = None,
                        classifiers: Sequence[Any] = ()) -> str:
    """The chosen layers with their geometry and backward costs.

    Backward FLOPs are per image, the unit of the budget's
    ``backward_gflops`` and of its logged line
    (:meth:`~.step_profile.step_cost.StepCost.describe`); with the trained
    classifiers given, their exact backward is a row of its own and part of
    the total, as the budget counts it, so the two totals are one figure.
    Saved activations are those of a step of ``batch`` images, as the
    budget's "kept for backward". The last column, ``runs``, is the
    implementation each chosen layer runs on a contiguous input of its
    traced shape (:func:`~mmseg_gf.models.layer_paths.layer_path`: the
    dispatcher's ``triton``, ``c++``, ``torch: <first refusal>``, or
    ``exact``); it depends on the machine (kernels built, triton, device).

    Args:
        model: the (unwrapped) segmentor, for trainable-parameter counts.
        choices: the applied layers (anything with ``path``, ``module``,
            ``radius``, ``in_shape``, ``out_shape`` and ``geometry``, a
            :class:`~mmseg_gf.models.layer_kinds.LayerGeometry`, as
            :class:`~mmseg_gf.engine.selection.LayerChoice`).
        batch: training batch size (the saved columns).
        mode: 'gf' or 'vanilla' (shown in the title).
        needs_input_grad: path -> whether the layer computes ``g_x`` (its
            input depends on a trained layer). Default: every layer but the
            first in execution order (an upper bound: branches fed by
            frozen features need no ``g_x``).
        classifiers: the trained classifiers that run in a training step
            (``path``, ``module``, ``in_shape``, ``out_shape``, ``geometry``:
            the trace's records), trained exactly in both modes.
    """
    header = ('path', 'k/s/d/g', 'in->out', 'r', 'params', 'bwd/img vanilla',
              'bwd/img GF', 'saved vanilla', 'saved GF', 'runs')
    needs = needs_input_grad or {}
    rows: List[Sequence[str]] = []
    tot = [0, 0, 0, 0]
    layers = [(c, c.radius, needs.get(c.path, i > 0), True)
              for i, c in enumerate(choices)]
    layers += [(c, 1, needs.get(c.path, True), False) for c in classifiers]
    for c, radius, need_x, chosen in layers:
        cost = c.geometry.cost(radius, need_input_grad=need_x)
        saved = c.geometry.cost(radius, batch=batch, need_input_grad=need_x)
        flops = (cost.vanilla_flops, cost.gf_flops if chosen else
                 cost.vanilla_flops)
        tot[0] += flops[0]
        tot[1] += flops[1]
        if chosen:
            tot[2] += saved.vanilla_saved_bytes
            tot[3] += saved.gf_saved_bytes
        rows.append((
            c.path, c.geometry.describe(),
            f'{c.in_shape[1]}x{c.in_shape[2]}->'
            f'{c.out_shape[1]}x{c.out_shape[2]}',
            str(radius) if chosen else 'exact', str(_trained(c.module)),
            fmt_flops_short(flops[0]), fmt_flops_short(flops[1]),
            _log_mib(saved.vanilla_saved_bytes) if chosen else '',
            _log_mib(saved.gf_saved_bytes) if chosen else '',
            _runs(c, need_x) if chosen else ''))
    rows.append(('total (+classifier/norm params)', '', '', '',
                 str(_trained(model)), fmt_flops_short(tot[0]),
                 fmt_flops_short(tot[1]), _log_mib(tot[2]),
                 _log_mib(tot[3]), ''))
    noun = layers_noun(getattr(c, 'kind', CONV2D.name) for c in choices)
    title = (f'Gradient filter ({mode}): {len(choices)} layers; backward '
             f'FLOPs per image of the chosen {noun}'
             + (' and the trained classifier' + 's' * (len(classifiers) > 1)
                if classifiers else '')
             + f'; activations they save in a step of batch {batch}')
    return title + '\n' + format_table(header, rows, style='text',
                                       rule=False)


def _runs(choice: Any, need_input_grad: bool) -> str:
    """The dispatcher's label of the path ``choice``'s layer takes."""
    x = representative_input(choice.module, choice.in_shape,
                             need_input_grad)
    return layer_path(choice.module, x) or ''


def _trained(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


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
