"""Every "last N convs at radius r" setting of a model, costed.

``tools/analyze_cost.py CONFIG --sweep`` prints this table: for N = 1 ..
all and each candidate radius, the predicted backward GFLOPs per image, the
bytes the step keeps for backward and its peak (from one profile of the
model, :func:`mmseg_gf.engine.budget.profile_segmentor`), marking the
settings a budget allows and the one
:func:`~mmseg_gf.accounting.budget.choose_by_budget` picks (which may mix
radii). A plot shows each cost
against N, one line per radius, with the budget's limits.
"""
import os
import os.path as osp
from typing import Any, Dict, List, Optional, Sequence

from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from ..accounting.budget import (DEFAULT_RADII, LIMIT_KEYS, BudgetChoice,
                                 check_budget, choose_by_budget, fits)
from ..accounting.format import format_table
from ..accounting.profile import StepCostProfile
from ..engine.budget import profile_segmentor

__all__ = ['config_sweep', 'sweep_rows', 'sweep_markdown', 'sweep_plot']

#: Table / json columns: limit key -> header.
COLUMNS = {'backward_gflops': 'backward GFLOPs / image',
           'saved_mib': 'kept for backward (MiB)',
           'peak_mib': 'step peak (MiB)'}


def sweep_rows(profile: StepCostProfile, radii: Sequence[int], batch: int,
               budget: Optional[Dict[str, Any]] = None) -> List[dict]:
    """One row per (N, r): the predicted costs and whether they fit.

    Args:
        profile: the model's profile (with ``timeline`` for the peak).
        radii: radii to sweep.
        batch: images per step.
        budget: limits to mark (optional).

    Returns:
        list[dict]: ``num_layers``, ``radius``, ``backward_gflops``,
        ``saved_mib``, ``peak_mib`` (None without a timeline) and
        ``fits`` (None without a budget).
    """
    limits = None
    if budget is not None:
        checked = check_budget(budget)
        limits = {k: checked[k] for k in LIMIT_KEYS}
    rows = []
    for n in range(1, profile.max_layers + 1):
        for r in radii:
            cost = profile.cost(n, r, batch)
            rows.append(dict(
                num_layers=n, radius=r,
                backward_gflops=cost.backward_gflops,
                saved_mib=cost.saved_mib, peak_mib=cost.peak_mib,
                fits=None if limits is None else fits(cost, limits)))
    return rows


def sweep_markdown(rows: List[dict],
                   choice: Optional[BudgetChoice] = None) -> str:
    """The sweep as a markdown table, with the budget's choice below."""
    keys = [k for k in COLUMNS if any(r[k] is not None for r in rows)]
    marks = any(r['fits'] is not None for r in rows)
    header = ['N', 'r'] + [COLUMNS[k] for k in keys] + (
        ['fits the budget'] if marks else [])
    body = []
    for row in rows:
        cells = [str(row['num_layers']), str(row['radius'])]
        cells += [f'{row[k]:.4g}' for k in keys]
        if marks:
            cells.append('yes' if row['fits'] else '')
        body.append(cells)
    text = format_table(header, body,
                        align='rr' + 'r' * len(keys) + ('l' if marks else ''))
    if choice is not None:
        text += f'\n\nChosen: {choice.summary()}'
    return text


def sweep_plot(rows: List[dict], path: str,
               limits: Optional[Dict[str, Optional[float]]] = None,
               title: str = '') -> None:
    """Each cost against N, one line per radius; limits as dashed lines."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    keys = [k for k in COLUMNS if any(r[k] is not None for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4),
                             squeeze=False)
    for ax, key in zip(axes[0], keys):
        for r in sorted({row['radius'] for row in rows}):
            points = [(row['num_layers'], row[key]) for row in rows
                      if row['radius'] == r]
            ax.plot(*zip(*points), marker='.', label=f'r = {r}')
        if limits and limits.get(key) is not None:
            ax.axhline(limits[key], color='k', ls='--', lw=0.8,
                       label='budget')
        ax.set_xlabel('N (last convs trained)')
        ax.set_title(COLUMNS[key])
        ax.set_yscale('log')
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def config_sweep(cfg, input_size: Sequence[int], batch: int,
                 budget: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Profile a config's segmentor and sweep its settings.

    Args:
        cfg (mmengine.Config): its ``model`` (plain, or the
            ``GradFilterModel`` of a rewritten config); its
            ``gradient_filter`` budget is used when ``budget`` is None.
        input_size: ``(H, W)`` (the training crop).
        batch: images per step.
        budget: limits to mark and choose by (optional).

    Returns:
        dict: ``rows`` (:func:`sweep_rows`), ``choice`` (the budget's,
        :class:`BudgetChoice` or None), ``error`` (why nothing fits, or
        None), ``radii``, ``limits``.
    """
    register_all_modules(init_default_scope=False)
    model_cfg = dict(cfg.model)
    if model_cfg.get('type') == 'GradFilterModel':
        model_cfg = dict(model_cfg['model'])
    if budget is None:
        budget = (cfg.get('gradient_filter') or {}).get('budget')
    checked = check_budget(budget) if budget is not None else None
    radii = checked['radii'] if checked else DEFAULT_RADII
    # a config inheriting default_scope from a base has no _scope_ (see
    # mmseg_gf.engine.build.build_segmentor)
    model_cfg.setdefault('_scope_', cfg.get('default_scope') or 'mmseg')
    segmentor = MODELS.build(model_cfg)
    profile = profile_segmentor(segmentor, input_size, timeline=True)
    rows = sweep_rows(profile, radii, batch, checked)
    choice = error = None
    if checked is not None:
        try:
            choice = choose_by_budget(profile, checked, batch)
        except ValueError as exc:  # nothing fits: the message says why
            error = str(exc)
    return dict(rows=rows, choice=choice, error=error, radii=list(radii),
                limits=({k: checked[k] for k in LIMIT_KEYS}
                        if checked else None))

