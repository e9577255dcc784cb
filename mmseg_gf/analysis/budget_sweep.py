"""Every "last N convs at radius r" setting of a model, costed.

The table of ``tools/analyze_cost.py CONFIG --sweep``: predicted backward
GFLOPs, saved bytes and peak per (N, r) from one profile of the model,
marking what a budget allows and what it picks; a plot shows each cost
against N.
"""
import copy
import os
import os.path as osp
from typing import Any, Dict, List, Optional, Sequence

import torch
from mmengine.config import Config
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from ..accounting.budget import (DEFAULT_RADII, LIMIT_KEYS, BudgetChoice,
                                 check_budget, choose_by_budget, fits)
from ..accounting.batch import random_batch, training_loss
from ..accounting.format import MIB, format_table
from ..accounting.measured import profiled_peak_bytes, saved_tensor_bytes
from ..accounting.step_profile import StepCostProfile
from ..engine.budget import profile_segmentor
from ..engine.build import build_segmentor
from ..engine.config import config_settings, patch_means_on
from ..engine.patch_mean_activations import install_patch_mean_gelus
from ..engine.selection import select_layers
from ..engine.surgery import apply_gradient_filter
from ..engine.zoo import ZOO_FAMILIES, family_config, make_offline
from ..models.layer_kinds import CONV2D

__all__ = ['config_sweep', 'sweep_rows', 'sweep_markdown', 'sweep_plot',
           'measured_step_peak', 'predicted_vs_measured',
           'config_predicted_vs_measured', 'family_predicted_vs_measured',
           'file_predicted_vs_measured', 'families_markdown']

#: Table / json columns: limit key -> header.
COLUMNS = {'backward_gflops': 'backward GFLOPs / image',
           'saved_mib': 'kept for backward (MiB)',
           'peak_mib': 'step peak (MiB)'}


def sweep_rows(profile: StepCostProfile, radii: Sequence[int], batch: int,
               budget: Optional[Dict[str, Any]] = None) -> List[dict]:
    """One row per (N, r): the predicted costs and whether they fit.

    Returns:
        list[dict]: ``num_layers``, ``radius``, ``backward_gflops``,
        ``saved_mib``, ``peak_mib`` (None without a timeline) and ``fits``
        (None without a budget).
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
        ax.set_xlabel('N (last layers trained)')
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
        cfg (mmengine.Config): its ``model``, plain or rewritten; its
            ``gradient_filter`` budget is used when ``budget`` is None.
        input_size: ``(H, W)`` (the training crop).
        batch: images per step.
        budget: limits to mark and choose by (optional).

    Returns:
        dict: ``rows``, ``choice`` (or None), ``error`` (why nothing fits, or
        None), ``radii``, ``limits``.
    """
    register_all_modules(init_default_scope=False)
    model_cfg = dict(cfg.model)
    if model_cfg.get('type') == 'GradFilterModel':
        model_cfg = dict(model_cfg['model'])
    settings = config_settings(cfg)
    if budget is None and settings is not None:
        budget = settings.budget
    checked = check_budget(budget) if budget is not None else None
    radii = checked['radii'] if checked else DEFAULT_RADII
    # a config inheriting default_scope from a base has no _scope_ (see
    # mmseg_gf.engine.build.build_segmentor)
    model_cfg.setdefault('_scope_', cfg.get('default_scope') or 'mmseg')
    segmentor = MODELS.build(model_cfg)
    profile = profile_segmentor(
        segmentor, input_size, timeline=True,
        layer_kinds=None if settings is None else settings.layer_kinds,
        patch_mean_activations=patch_means_on(settings))
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



def measured_step_peak(model, input_size: Sequence[int], batch: int,
                       device: str = 'cpu') -> int:
    """Measured peak live tensor bytes of one training step after a warm-up."""
    params = [p for p in model.parameters() if p.requires_grad]
    inputs, samples = random_batch(model, input_size, batch, device=device)

    def step():
        training_loss(model, inputs, samples).backward()

    # cuDNN's benchmark mode (on for the whole process once an mmengine
    # Runner builds mmseg's default_runtime) picks the fastest algorithms
    # whatever their workspace, which max_memory_allocated counts: on an
    # H100 a test process measured 1.1 GB for PSPNet-R18 at 128x128 where a
    # fresh one measures 27.1 MiB (the budget predicts 26.8). The budget
    # models tensors: the step is measured with torch's default, cuDNN's
    # heuristic choice.
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        step()  # warm-up: lazy allocations, kernel choice
        for p in params:
            p.grad = None
        peak = profiled_peak_bytes(step, device)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    for p in params:
        p.grad = None
    return peak


def predicted_vs_measured(model, input_size: Sequence[int], batch: int,
                          settings: Sequence[Optional[int]],
                          radius: int = 4,
                          layer_kinds: Optional[Sequence[str]] = (
                              CONV2D.name, )) -> List[dict]:
    """The budget's predictions of "last N at ``radius``" next to the model
    built so.

    Measured: the bytes autograd saves in one forward and the step's peak of a
    copy of ``model`` filtered as ``gradient_filter=dict(num_layers=N, ...)``
    builds it.

    Args:
        model: the plain segmentor (not changed).
        input_size: ``(H, W)``.
        batch: images per step.
        settings: values of N; None for every candidate conv.
        radius: of every trained conv.
        layer_kinds: the kinds N counts (default: convs); None: every kind.

    Returns:
        list[dict]: per setting ``num_layers``, ``all``, ``predicted_kept``,
        ``measured_kept``, ``predicted_peak``, ``measured_peak`` (bytes).
    """
    size = tuple(int(v) for v in input_size)
    kinds = None if layer_kinds is None else list(layer_kinds)
    # the pool of the model built below
    profile = profile_segmentor(model, size, timeline=True,
                                layer_kinds=kinds)
    rows = []
    for n in settings:
        n = profile.max_layers if n is None else min(int(n),
                                                     profile.max_layers)
        cost = profile.cost(n, radius, batch)
        built = copy.deepcopy(model)
        # the kinds the profile prices (profile_segmentor's pool)
        choices = select_layers(built, num_layers=n, radius=radius,
                                input_size=size, layer_kinds=kinds)
        apply_gradient_filter(built, choices, mode='gf', lean=True)
        install_patch_mean_gelus(built, size)
        inputs, samples = random_batch(built, size, batch)
        kept = saved_tensor_bytes(
            lambda: training_loss(built, inputs, samples))
        rows.append(dict(num_layers=n, all=n == profile.max_layers,
                         predicted_kept=cost.saved_bytes,
                         measured_kept=kept,
                         predicted_peak=cost.peak_bytes,
                         measured_peak=measured_step_peak(built, size,
                                                          batch)))
    return rows


def config_predicted_vs_measured(cfg, label: str,
                                 input_size: Sequence[int] = (128, 128),
                                 batch: int = 2, radius: int = 4,
                                 settings: Sequence[Optional[int]] = (10,
                                                                      None),
                                 seed: int = 0, *,
                                 layer_kinds: Optional[Sequence[str]] = (
                                     CONV2D.name, )) -> Dict[str, Any]:
    """:func:`predicted_vs_measured` on a plain config's segmentor, seeded."""
    size = tuple(int(v) for v in input_size)
    torch.manual_seed(seed)
    model = build_segmentor(cfg)
    rows = predicted_vs_measured(model, size, batch, list(settings), radius,
                                 layer_kinds)
    return dict(label=label, input_size=list(size), batch=batch,
                radius=radius, rows=rows,
                layer_kinds=None if layer_kinds is None else
                list(layer_kinds))


def family_predicted_vs_measured(name: str,
                                 input_size: Sequence[int] = (128, 128),
                                 batch: int = 2, radius: int = 4,
                                 settings: Sequence[Optional[int]] = (10,
                                                                      None),
                                 seed: int = 0, **kwargs) -> Dict[str, Any]:
    """:func:`config_predicted_vs_measured` on a zoo family, built offline."""
    cfg = make_offline(family_config(name))
    cfg.model.data_preprocessor['size'] = tuple(int(v) for v in input_size)
    return dict(family=name, **config_predicted_vs_measured(
        cfg, ZOO_FAMILIES[name].label, input_size, batch, radius, settings,
        seed, **kwargs))


def file_predicted_vs_measured(path: str, input_size: Sequence[int] = (128,
                                                                       128),
                               batch: int = 2, radius: int = 4,
                               settings: Sequence[Optional[int]] = (10, None),
                               seed: int = 0, offline: bool = False,
                               **kwargs) -> Dict[str, Any]:
    """:func:`config_predicted_vs_measured` on any mmseg config file, built
    plain."""
    cfg = Config.fromfile(path)
    if offline:
        make_offline(cfg)
    cfg.pop('gradient_filter', None)
    preprocessor = cfg.model.get('data_preprocessor')
    if preprocessor is not None and preprocessor.get('size') is not None:
        preprocessor['size'] = tuple(int(v) for v in input_size)
    label = osp.splitext(osp.basename(path))[0]
    return dict(config=path, **config_predicted_vs_measured(
        cfg, label, input_size, batch, radius, settings, seed, **kwargs))


def _off(row: dict, key: str) -> float:
    """Prediction over measurement, minus 1."""
    measured = row[f'measured_{key}']
    return row[f'predicted_{key}'] / measured - 1 if measured else 0.0


def families_markdown(results: Sequence[Dict[str, Any]]) -> str:
    """Kept and peak MiB, predicted / measured, one row per family."""
    header = ['model']
    first = results[0]['rows']
    convs = results[0].get('layer_kinds', [CONV2D.name]) == [CONV2D.name]
    for row in first:
        what = ('all convs' if convs else 'all layers') if row['all'] \
            else f'last {row["num_layers"]}'
        header += [f'{what}: kept', f'{what}: peak']
    header += ['kept off by', 'peak off by']
    body = []
    for res in results:
        cells = [res['label']]
        for row in res['rows']:
            cells.append(f'{row["predicted_kept"] / MIB:.2f} / '
                         f'{row["measured_kept"] / MIB:.2f}')
            cells.append(f'{row["predicted_peak"] / MIB:.1f} / '
                         f'{row["measured_peak"] / MIB:.1f}')
        for key in ('kept', 'peak'):
            worst = max((_off(r, key) for r in res['rows']), key=abs)
            cells.append(f'{100 * worst:+.1f}%')
        body.append(cells)
    return format_table(header, body, align='l' + 'r' * (len(header) - 1))
