"""What one GPU check measured, against its targets: ``tools/gpu_check.py``'s
report.

Every number is read from the files the benchmarks write; a target with
nothing measured says so instead of passing. The targets: docs/gpu.md.
"""
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..accounting.format import format_table
from .launch_count import TARGETS as LAUNCH_TARGETS
from .step_benchmark import parse_row, row_settings

__all__ = ['LayerRun', 'TargetCheck', 'layer_checks', 'step_checks',
           'launch_checks', 'launch_table', 'layer_runs_table',
           'summary_markdown']

#: (batch, radius) -> least median backward speedup with g_x (Triton).
MEDIAN_SPEEDUP_TARGETS = {(32, 2): 2.0, (32, 4): 3.0}
#: Least median weight-only backward speedup at batch 32 (Triton), per r.
WEIGHT_ONLY_TARGET = 10.0
#: Least backward speedup of every Linear at r = 4 (Triton, with g_x).
LINEAR_TARGET, LINEAR_RADIUS = 1.5, 4
#: Batch at which no layer may be slower than cuDNN (Triton).
NO_SLOWER_BATCH = 8
STEP_PEAK_TARGET = 1.5
STEP_TIME_TARGET = 1.3


@dataclass
class LayerRun:
    """One run of the layer benchmark: its settings and its json."""

    batch: int
    dtype: str
    triton: bool
    command: str
    result: Optional[Dict] = None  # layers.json; None: the run failed

    @property
    def name(self) -> str:
        return (f"batch {self.batch}, {self.dtype}, "
                f"{'Triton' if self.triton else 'no Triton'}")

    def speedups(self, case: str, radius: int,
                 kind: str = 'conv') -> List[float]:
        """Backward speedup over vanilla of every layer of a kind, case and
        radius."""
        if self.result is None:
            return []
        return [row['backward_speedup'] for row in self.result['rows']
                if row['case'] == case and row['radius'] == radius
                and row.get('kind', 'conv') == kind]

    def kinds(self) -> List[str]:
        """The layer kinds the run measured, convs first."""
        if self.result is None:
            return ['conv']
        found = {row.get('kind', 'conv') for row in self.result['rows']}
        return sorted(found, key=lambda kind: (kind != 'conv', kind))


@dataclass
class TargetCheck:
    """A target, what was measured and whether it holds (None: nothing
    measured)."""

    target: str
    measured: str
    holds: Optional[bool]

    @property
    def verdict(self) -> str:
        return {True: 'holds', False: 'MISSED', None: 'not measured'}[
            self.holds]


def layer_checks(runs: Sequence[LayerRun]) -> List[TargetCheck]:
    """The layer targets on the Triton runs, one check per dtype."""
    checks = []
    for dtype in sorted({run.dtype for run in runs}):
        for (batch, radius), target in MEDIAN_SPEEDUP_TARGETS.items():
            checks.append(_median_check(
                f'batch {batch}, {dtype}, r = {radius}: median backward '
                f'speedup over cuDNN with g_x >= {target:g}x',
                _triton_speedups(runs, batch, dtype, radius), target))
        for radius in sorted({r for _, r in MEDIAN_SPEEDUP_TARGETS}):
            values = _triton_speedups(runs, NO_SLOWER_BATCH, dtype, radius)
            worst = min(values) if values else None
            checks.append(TargetCheck(
                f'batch {NO_SLOWER_BATCH}, {dtype}, r = {radius}: no layer '
                'slower than cuDNN (with g_x)',
                '' if worst is None else f'slowest layer {worst:.2f}x',
                None if worst is None else worst >= 1.0))
        checks += _weight_only_checks(runs, dtype)
        checks += _linear_checks(runs, dtype)
    return checks


def _weight_only_checks(runs, dtype) -> List[TargetCheck]:
    checks = []
    for radius in sorted({r for _, r in MEDIAN_SPEEDUP_TARGETS}):
        checks.append(_median_check(
            f'batch 32, {dtype}, r = {radius}: median weight-only backward '
            f'speedup over cuDNN >= {WEIGHT_ONLY_TARGET:g}x',
            _triton_speedups(runs, 32, dtype, radius, 'weight_only'),
            WEIGHT_ONLY_TARGET))
    return checks


def _median_check(target: str, values: Sequence[float],
                  least: float) -> TargetCheck:
    median = statistics.median(values) if values else None
    return TargetCheck(target, '' if median is None else f'{median:.1f}x',
                       None if median is None else median >= least)


def _linear_checks(runs, dtype) -> List[TargetCheck]:
    checks = []
    for batch in sorted({run.batch for run in runs if run.dtype == dtype}):
        values = _triton_speedups(runs, batch, dtype, LINEAR_RADIUS,
                                  kind='linear')
        worst = min(values) if values else None
        checks.append(TargetCheck(
            f'batch {batch}, {dtype}, r = {LINEAR_RADIUS}: every Linear '
            f'>= {LINEAR_TARGET:g}x cuBLAS (with g_x)',
            '' if worst is None else f'slowest layer {worst:.2f}x',
            None if worst is None else worst >= LINEAR_TARGET))
    return checks


def _triton_speedups(runs, batch, dtype, radius, case='with_gx',
                     kind='conv') -> List[float]:
    return [v for run in runs if run.triton and run.batch == batch
            and run.dtype == dtype for v in run.speedups(case, radius, kind)]


def step_checks(results: Sequence[Dict]) -> List[TargetCheck]:
    """The step targets for every lean GF row of a ``steps.json``."""
    checks = []
    for result in results:
        rows = {row['row']: row for row in result['rows']}
        for row in result['rows']:
            strategy, lean = parse_row(row['row'])
            if not lean or not strategy.startswith('gf_'):
                continue
            where = f"{result['label']} {row['row']}"
            checks.append(_ratio_check(
                f'{where}: step peak <= {STEP_PEAK_TARGET:g}x inference',
                row.get('peak_vs_inference'), STEP_PEAK_TARGET))
            checks.append(_ratio_check(
                f'{where}: step time <= {STEP_TIME_TARGET:g}x inference',
                row.get('step_vs_inference'), STEP_TIME_TARGET))
            vanilla = rows.get(_same_layers_vanilla(row['row']))
            ratio = (row['step'] / vanilla['step'] if vanilla is not None
                     and 'step' in row and 'step' in vanilla else None)
            checks.append(_ratio_check(
                f'{where}: step time <= vanilla, the same layers, '
                'lean=False', ratio, 1.0))
    return checks


def _same_layers_vanilla(row: str) -> str:
    """``'gf_last10_r4:lean'`` -> ``'vanilla_last10:plain'``."""
    return f"vanilla_last{row_settings(row)['num_layers']}:plain"


def _launch_ratios(result: Dict) -> List[tuple]:
    """``(lean row, vanilla row, forward ratio, step ratio)`` of one model."""
    return [(c['lean'], c['vanilla'], c['ratios']['forward'],
             c['ratios']['step']) for c in result.get('comparisons', [])]


def launch_checks(recorded: Sequence[Dict],
                  golden: Dict) -> List[TargetCheck]:
    """The launch targets on the kernels recorded on the GPU."""
    checks = []
    for result in recorded:
        for lean, _, forward, step in _launch_ratios(result):
            where = f"{result['label']} {lean}, kernels recorded"
            checks.append(_ratio_check(
                f"{where}: forward <= {LAUNCH_TARGETS['forward']:g}x "
                'vanilla-same-layers', forward, LAUNCH_TARGETS['forward']))
            checks.append(_ratio_check(
                f"{where}: step <= {LAUNCH_TARGETS['step']:g}x "
                'vanilla-same-layers', step, LAUNCH_TARGETS['step']))
    return checks


def launch_table(recorded: Sequence[Dict], golden: Dict) -> str:
    """Kernels per phase recorded on the GPU next to the CPU's golden count."""
    body = []
    for result in recorded:
        counted = golden.get(result['model'], {})
        for row in result['rows']:
            cpu = counted.get(row['row'], {})
            body.append([result['label'], row['row']] + [
                f"{row[p]['launches']} / {cpu.get(p, {}).get('launches', '?')}"
                for p in ('forward', 'backward', 'optimizer', 'step')])
    return format_table(('model', 'row', 'forward', 'backward', 'optimizer',
                         'step'), body, align='ll' + 'r' * 4)


def _ratio_check(target: str, value: Optional[float],
                 limit: float) -> TargetCheck:
    return TargetCheck(target, '' if value is None else f'{value:.2f}x',
                       None if value is None else value <= limit)


def layer_runs_table(runs: Sequence[LayerRun]) -> str:
    """Per run and kind, the median and slowest backward speedup per radius
    (markdown)."""
    radii = sorted({row['radius'] for run in runs if run.result
                    for row in run.result['rows']})
    headers = ['run', 'layers'] + [f'{stat} r = {r}' for r in radii
                                   for stat in ('median', 'slowest')]
    table = []
    for run in runs:
        for kind in run.kinds():
            cells = [run.name, kind]
            for radius in radii:
                values = run.speedups('with_gx', radius, kind)
                cells += ([f'{statistics.median(values):.1f}x',
                           f'{min(values):.2f}x'] if values
                          else ['failed'] * 2)
            table.append(cells)
    return format_table(headers, table,
                        align='ll' + 'r' * (len(headers) - 2))


def summary_markdown(environment: Dict[str, str],
                     checks: Sequence[TargetCheck],
                     stages: Sequence[Dict],
                     launch_comparison=None) -> str:
    """The check's summary: environment, stages, targets and launch
    comparison."""
    lines = ['# GPU check', '']
    lines += [f'- {key}: {value}' for key, value in environment.items()]
    lines += ['', '## Stages', '', format_table(
        ('stage', 'outcome', 'seconds'),
        [(s['name'], s['outcome'], f"{s['seconds']:.0f}") for s in stages],
        align='llr'), '', '## Targets', '']
    if checks:
        lines.append(format_table(
            ('target', 'measured', 'verdict'),
            [(c.target, c.measured, c.verdict) for c in checks],
            align='lrl'))
    else:
        lines.append('Nothing measured.')
    if launch_comparison and launch_comparison[0]:
        lines += ['', '## Kernels per step: recorded on the GPU / counted '
                  'on a CPU (64x64, batch 1)', '',
                  launch_table(*launch_comparison)]
    return '\n'.join(lines) + '\n'

