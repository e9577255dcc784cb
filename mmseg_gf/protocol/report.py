"""results.md / results.csv / runs.csv / results.png in the layout of
Tables 3 and 9 (and a Fig. 4-like plot: mIoU vs backward GFLOPs, log x).

Each strategy row: Method, #Layers, r, GFLOPs, then mIoU and mAcc at the
final iteration and the best validation mIoU (with the mAcc of that
validation), each as ``mean [std]`` over the seeds that finished (sample
standard deviation; ``[-]`` for a single run).
"""
import csv
import math
import os.path as osp
from typing import Any, Dict, List, Optional, Sequence

from ..accounting.format import format_table

__all__ = ['Row', 'summarize', 'write_report', 'mean_std', 'fmt_mean_std',
           'plot_results_csv']

METRICS = ('mIoU', 'mAcc', 'best_mIoU', 'best_mAcc')


def mean_std(values: Sequence[float]):
    """``(mean, sample std)``; std is None for fewer than 2 values, both
    None for none."""
    values = [float(v) for v in values]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    var = sum((v - mean)**2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var)


def fmt_mean_std(values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    if mean is None:
        return 'n/a'
    return f'{mean:.2f} [{"-" if std is None else f"{std:.2f}"}]'


def _method(cost: Dict[str, Any]) -> str:
    return dict(calib='Calibration', classifier='Classifier only',
                vanilla='Vanilla BP', gf='Ours').get(cost['mode'],
                                                     cost['mode'])


def _fmt_gflops(v: float) -> str:
    if v == 0:
        return '0'
    if v >= 100:
        return f'{v:.1f}'
    if v >= 0.01:
        return f'{v:.2f}'
    return f'{v:.2g}'


class Row:
    """One strategy: its cost and the results of its seeds.

    Args:
        strategy: strategy name.
        cost: :func:`mmseg_gf.protocol.flops.strategy_cost` result.
        results: ``result.json`` contents of the finished runs.
    """

    def __init__(self, strategy: str, cost: Dict[str, Any],
                 results: List[Dict[str, Any]]) -> None:
        self.strategy = strategy
        self.cost = cost
        self.results = results

    def values(self, key: str) -> List[float]:
        out = []
        for r in self.results:
            if key.startswith('best_'):
                v = (r.get('best') or {}).get(key[len('best_'):])
            else:
                v = (r.get('final') or {}).get(key)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                out.append(float(v))
        return out

    @property
    def method(self) -> str:
        return _method(self.cost)

    @property
    def seeds(self) -> List[int]:
        return [int(r['seed']) for r in self.results]


def summarize(rows: List[Row]) -> List[Dict[str, Any]]:
    """Rows as flat dicts (the columns of results.csv)."""
    out = []
    for row in rows:
        d = dict(strategy=row.strategy, method=row.method,
                 layers=row.cost['layers'], radius=row.cost['radius'],
                 gflops=round(row.cost['gflops'], 6),
                 n_seeds=len(row.results),
                 seeds=' '.join(str(s) for s in row.seeds))
        for key in METRICS:
            mean, std = mean_std(row.values(key))
            d[f'{key}_mean'] = None if mean is None else round(mean, 4)
            d[f'{key}_std'] = None if std is None else round(std, 4)
        out.append(d)
    return out


def _markdown(title: str, notes: Sequence[str], rows: List[Row]) -> str:
    lines = [f'# {title}', '']
    lines += [f'{n}' for n in notes]
    lines += ['', format_table(
        ('Method', 'Strategy', '#Layers', 'r', 'GFLOPs', 'mIoU', 'mAcc',
         'best mIoU', 'mAcc @ best', 'seeds'),
        [(row.method, row.strategy, row.cost['layers'], row.cost['radius'],
          _fmt_gflops(row.cost['gflops']),
          *(fmt_mean_std(row.values(k)) for k in METRICS), len(row.results))
         for row in rows], align='ll' + 'r' * 8)]
    runs = []
    for row in rows:
        for r in row.results:
            fin, best = r.get('final') or {}, r.get('best') or {}
            runs.append((
                row.strategy, r['seed'], r.get('max_iters'),
                f'{fin.get("mIoU", float("nan")):.2f}',
                f'{fin.get("mAcc", float("nan")):.2f}',
                f'{fin.get("aAcc", float("nan")):.2f}',
                f'{best.get("mIoU", float("nan")):.2f} '
                f'({best.get("iter", "-")})',
                f'{r.get("seconds", 0) / 60:.1f} min'))
    lines += ['', '## Runs', '', format_table(
        ('Strategy', 'seed', 'iters', 'mIoU', 'mAcc', 'aAcc',
         'best mIoU (iter)', 'time'), runs, align='l' + 'r' * 7)]
    return '\n'.join(lines) + '\n'


#: One plotted strategy: mode (``calib``, ``classifier``, ``vanilla``,
#: ``gf``), method, radius, GFLOPs, #layers, mIoU mean, mIoU std.
Point = tuple


def _plot(path: str, title: str, rows: List[Row]) -> Optional[str]:
    """mIoU (final, mean +- std) vs backward GFLOPs on a log axis;
    calibration (and classifier-only) as horizontal lines. None if
    matplotlib is missing."""
    points = []
    for row in rows:
        mean, std = mean_std(row.values('mIoU'))
        if mean is not None:
            points.append((row.cost['mode'], row.method, row.cost['radius'],
                           row.cost['gflops'], row.cost['layers'], mean,
                           std))
    return _plot_points(path, title, points)


def plot_results_csv(csv_path: str, png_path: str,
                     title: str) -> Optional[str]:
    """:func:`write_report`'s plot again, from its ``results.csv`` alone
    (``tools/plot_results.py``: the README's figure); None if matplotlib is
    missing."""
    modes = {method: mode for mode, method in (
        ('calib', 'Calibration'), ('classifier', 'Classifier only'),
        ('vanilla', 'Vanilla BP'), ('gf', 'Ours'))}
    points = []
    with open(csv_path, newline='') as f:
        for r in csv.DictReader(f):
            if not r['mIoU_mean']:
                continue
            points.append((modes.get(r['method'], r['method']), r['method'],
                           r['radius'], float(r['gflops']), r['layers'],
                           float(r['mIoU_mean']),
                           float(r['mIoU_std']) if r['mIoU_std'] else None))
    return _plot_points(png_path, title, points)


def _plot_points(path: str, title: str,
                 points: List[Point]) -> Optional[str]:
    """The plot of :func:`_plot` for ``points``."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib comes with mmengine
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    # One series per method and patch size (Fig. 4: Baseline, Ours-R2,
    # Ours-R4), its points joined in order of cost.
    series: Dict[str, List] = {}
    for mode, method, radius, gflops, layers, mean, std in points:
        if mode in ('calib', 'classifier'):  # no conv trained: a line
            ax.axhline(mean, ls='--' if mode == 'calib' else ':',
                       color='gray', lw=1)
            ax.annotate(method, (0.01, mean), xycoords=(
                'axes fraction', 'data'), va='bottom', fontsize=8,
                color='gray')
            continue
        label = method if mode != 'gf' else f'{method} r={radius}'
        series.setdefault(label, []).append(
            (max(gflops, 1e-6), mean, std or 0.0, str(layers)))
    markers = 'o^sDvP*X'
    plotted = False
    for i, (label, points) in enumerate(series.items()):
        points.sort()
        xs, ys, es, names = zip(*points)
        ax.errorbar(xs, ys, yerr=es, fmt=markers[i % len(markers)] + '-',
                    capsize=3, label=label, lw=1)
        for x, y, name in zip(xs, ys, names):
            ax.annotate(name, (x, y), textcoords='offset points',
                        xytext=(5, 4), fontsize=8)
        plotted = True
    if plotted:
        ax.set_xscale('log')
    ax.set_xlabel('backward GFLOPs per image (log scale)')
    ax.set_ylabel('mIoU [%] (final iteration)')
    ax.set_title(title, fontsize=10)
    ax.grid(True, which='both', alpha=0.3)
    if plotted:
        ax.legend(fontsize=8, loc='lower right')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(out_dir: str, title: str, notes: Sequence[str],
                 rows: List[Row]) -> Dict[str, str]:
    """Write results.md, results.csv, runs.csv and results.png.

    Returns:
        name -> path of what was written.
    """
    written = {}
    md = osp.join(out_dir, 'results.md')
    with open(md, 'w') as f:
        f.write(_markdown(title, notes, rows))
    written['md'] = md
    table = summarize(rows)
    path = osp.join(out_dir, 'results.csv')
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]) if table else
                                ['strategy'])
        writer.writeheader()
        for d in table:
            writer.writerow(d)
    written['csv'] = path
    path = osp.join(out_dir, 'runs.csv')
    with open(path, 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow([
            'strategy', 'seed', 'max_iters', 'mIoU', 'mAcc', 'aAcc',
            'best_mIoU', 'best_mAcc', 'best_iter', 'seconds', 'work_dir'
        ])
        for row in rows:
            for r in row.results:
                fin, best = r.get('final') or {}, r.get('best') or {}
                writer.writerow([
                    row.strategy, r['seed'], r.get('max_iters'),
                    fin.get('mIoU'), fin.get('mAcc'), fin.get('aAcc'),
                    best.get('mIoU'), best.get('mAcc'), best.get('iter'),
                    round(r.get('seconds', 0), 1), r.get('work_dir')
                ])
    written['runs_csv'] = path
    png = _plot(osp.join(out_dir, 'results.png'), title, rows)
    if png:
        written['png'] = png
    return written
