"""Tables and plot of :func:`~.step_benchmark.benchmark_model`'s results.

Only what a run measured is shown: a memory-only run has no time columns or
panel, a ``--no-memory`` run no byte columns, peak or kept panel.
"""
from typing import Dict, List, Optional, Sequence

from ..accounting.format import fmt_mib, format_table

__all__ = ['FINETUNE_ITERS', 'step_table', 'kept_by_kind_table', 'plot']

#: The protocol's finetuning length, for the "20k steps" column.
FINETUNE_ITERS = 20000


def _mib(v: Optional[float]) -> str:
    return fmt_mib(v, 1)


def _ratio(v: Optional[float], digits: int = 2) -> str:
    return '' if v is None else f'{v:.{digits}f}'


def step_table(result: Dict) -> str:
    """One model's rows as a markdown table, without columns no row
    measured."""
    headers = ('row', 'fwd s', 'bwd s', 'step s', 'step / inference fwd',
               'lean / plain step', 'compiled / eager step', 'peak MiB',
               'peak / inference',
               'saved MiB', 'analytic MiB', 'saved / vanilla plain',
               '20k steps (h)')
    rows = [(r['row'], _seconds(r.get('forward')), _seconds(r.get('backward')),
             _seconds(r.get('step')), _ratio(r.get('step_vs_inference')),
             _ratio(r.get('step_vs_plain'), 3),
             _ratio(r.get('step_vs_eager'), 3), _mib(r['peak_bytes']),
             _ratio(r.get('peak_vs_inference')), _mib(r['saved_bytes']),
             _mib(r.get('analytic_saved_bytes')),
             _ratio(r.get('saved_vs_vanilla_plain'), 3),
             '' if 'step' not in r else
             f"{r['step'] * FINETUNE_ITERS / 3600:.1f}")
            for r in result['rows']]
    keep = [i for i in range(len(headers))
            if i == 0 or any(row[i] != '' for row in rows)]
    return format_table([headers[i] for i in keep],
                        [[row[i] for i in keep] for row in rows],
                        align='l' + 'r' * (len(keep) - 1))


def kept_by_kind_table(result: Dict) -> str:
    """The lean rows' kept bytes by kind (MiB); '' when no row has the
    count."""
    rows = [r for r in result['rows'] if r.get('analytic_by_category')]
    if not rows:
        return ''
    kinds = [k for k in rows[0]['analytic_by_category']
             if any(r['analytic_by_category'].get(k) for r in rows)]
    body = [[r['row'], _mib(r['analytic_saved_bytes'])] +
            [_mib(r['analytic_by_category'].get(k, 0)) for k in kinds]
            for r in rows]
    return format_table(['row (kept MiB)', 'total'] + kinds, body,
                        align='l' + 'r' * (len(kinds) + 1))


def _seconds(v: Optional[float]) -> str:
    return '' if v is None else f'{v:.3f}'


#: The plot's panels: result key, title, a line at 1 (the yardstick).
PLOT_PANELS = (('peak_vs_inference', 'step peak / inference peak', True),
               ('step_vs_inference', 'step time / inference forward time',
                True),
               ('saved_vs_vanilla_plain', 'kept for backward / vanilla, the '
                'same layers, lean=False', False))


def _row_values(results: Sequence[Dict], row: str, key: str) -> List[float]:
    """One row's ``key`` per model (NaN where the model has none)."""
    nan = float('nan')
    out = []
    for res in results:
        value = next((r.get(key) for r in res['rows'] if r['row'] == row),
                     None)
        out.append(nan if value is None else float(value))
    return out


def _model_label(res: Dict, crops_differ: bool) -> str:
    label = res.get('label', res['model'])
    if crops_differ:
        label += f"\n{res['crop'][0]}x{res['crop'][1]}"
    return label


def _measured_panels(results: Sequence[Dict], names: Sequence[str]):
    """``(key, title, line at 1, rows)`` for each panel some row measured."""
    panels = []
    for key, title, yardstick in PLOT_PANELS:
        rows = [name for name in names
                if any(v == v for v in _row_values(results, name, key))
                and not (key == 'saved_vs_vanilla_plain'
                         and name.startswith('vanilla'))]
        if rows:
            panels.append((key, title, yardstick, rows))
    return panels


def plot(results: Sequence[Dict], path: str) -> bool:
    """Ratios per row, one panel per measured ratio, one bar group per model.

    Returns:
        whether a plot was written (``False``: no ratio was measured).
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np
    names = [r['row'] for r in results[0]['rows'] if r['lean'] is not None]
    panels = _measured_panels(results, names)
    if not panels:
        return False
    colours = {name: f'C{i % 10}' for i, name in enumerate(names)}
    crops_differ = len({tuple(res['crop']) for res in results}) > 1
    width_in = min(20.0, max(7.0, 0.3 * len(names) * len(results) + 2))
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(width_in, 3.2 * len(panels) + 1.2))
    x = np.arange(len(results))
    for ax, (key, title, yardstick, rows) in zip(axes[:, 0], panels):
        width = 0.8 / len(rows)
        for i, name in enumerate(rows):
            ax.bar(x + (i - len(rows) / 2 + 0.5) * width,
                   _row_values(results, name, key), width,
                   color=colours[name])
        if yardstick:
            ax.axhline(1.0, color='k', lw=0.8)
        ax.set_xticks(x, [_model_label(res, crops_differ)
                          for res in results], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis='y', alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    fig.legend(handles, names, loc='lower center', ncol=min(len(names), 6),
               fontsize=8, frameon=False)
    first = results[0]
    crop = '' if crops_differ else \
        f"crop {first['crop'][0]}x{first['crop'][1]}, "
    fig.suptitle(f"{crop}batch {first['batch']}, {first['threads']} "
                 f"threads, torch {first['torch']}", fontsize=10)
    legend_in = 0.3 * -(-len(names) // 6) + 0.1
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
