"""Kernel launches and bytes moved by training steps, lean GF against
vanilla-same-layers, on the path CUDA tensors take, counted on a CPU.

Each row's segmentor counts one SGD step after an uncounted one, per phase
and kind, and each lean row is compared with its vanilla-same-layers row
against :data:`TARGETS`. The counts depend on the code and the shapes,
not on the machine.
"""
import os
import os.path as osp
from typing import Dict, List, Optional, Sequence

import torch

from ..accounting.batch import random_batch, training_loss
from ..accounting.cuda_kernels import record_step_kernels
from ..accounting.format import MIB, format_table
from ..accounting.launches import KINDS, count_step
from ..engine.build import build_segmentor
from ..engine.tool_args import write_json
from ..ops.backend import availability, triton_runtime
from .step_benchmark import lean_against_vanilla, parse_row
from .step_jobs import Job

__all__ = ['TARGETS', 'build_uninterpreted', 'count_row', 'count_model',
           'compare', 'summary_table', 'kind_table', 'write_results',
           'run_jobs']

#: Lean GF over vanilla-same-layers, at most: forward launches, whole-step
#: launches (forward, backward, update), bytes the whole step moves.
TARGETS = dict(forward=1.1, step=1.0, bytes=1.0)


def count_row(cfg, crop: Sequence[int], batch: int = 1, warmup: int = 1,
              triton: bool = True, run_kernels: bool = False,
              device: str = 'cpu') -> Dict:
    """One row's counted step on a random batch (:meth:`LaunchCount.summary`).

    ``device='cuda'`` records the kernels launched on the GPU instead: per
    phase ``launches`` and ``by_name``, no bytes and no kinds.
    """
    torch.manual_seed(0)
    model = build_uninterpreted(cfg, device)
    inputs, samples = random_batch(model, crop, batch, label_block=16,
                                   device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=5e-4,
                          foreach=True)

    def step(phase) -> None:
        loss = training_loss(model, inputs, samples)
        phase('backward')
        loss.backward()
        phase('optimizer')
        opt.step()
        opt.zero_grad(set_to_none=True)

    if torch.device(device).type == 'cuda':
        return _as_summary(record_step_kernels(step, device,
                                               warmup=warmup + 1))
    return count_step(model, step, warmup=warmup, triton=triton,
                      run_kernels=run_kernels).summary()


def build_uninterpreted(cfg, device: str = 'cpu'):
    """``cfg``'s segmentor, built with the Triton path off under the
    interpreter.

    The build's traced forward would otherwise interpret every kernel
    (minutes for a zoo model) for the same result.
    """
    if not (triton_runtime.INTERPRETED and torch.device(device).type == 'cpu'):
        return build_segmentor(cfg).to(device)
    with availability.triton_switched(False):
        return build_segmentor(cfg).to(device)


def _as_summary(recorded: Dict) -> Dict:
    """Recorded CUDA kernels in :meth:`LaunchCount.summary`'s form."""
    return {phase: dict(launches=v['launches'], triton=0, read_bytes=0,
                        written_bytes=0, host_reads=0, by_kind={},
                        bytes_by_kind={}, by_op=v['by_name'],
                        host_us=v['host_us'], gpu_us=v['gpu_us'],
                        time_by_op=v['time_by_name'])
            for phase, v in recorded.items() if phase != 'unassigned'}


def count_model(job: Job, batch: int = 1, triton: bool = True,
                run_kernels: bool = False, progress=None,
                device: str = 'cpu') -> Dict:
    """Every row of one model counted and compared (:func:`compare`)."""
    name, label, crop, rows = job
    say = progress or (lambda message: None)
    counted = []
    for row, cfg in rows:
        say(f'[{name}] count {row}')
        strategy, lean = parse_row(row)
        if lean is None:
            raise ValueError(f'row {row!r}: the launch count needs a '
                             'training row (a gradient-filter setting)')
        counted.append(dict(row=row, strategy=strategy, lean=lean,
                            **count_row(cfg, crop, batch, triton=triton,
                                        run_kernels=run_kernels,
                                        device=device)))
    return dict(model=name, label=label, crop=list(crop), batch=int(batch),
                torch=torch.__version__,
                triton=('.'.join(map(str, triton_runtime.triton_version()))
                        if triton else None),
                kernels_run=bool(triton and run_kernels),
                rows=counted, comparisons=compare(counted))


def _ratio(a: int, b: int) -> Optional[float]:
    return a / b if b else None


def compare(rows: Sequence[Dict]) -> List[Dict]:
    """Each lean row against its vanilla-same-layers row: ratios and
    :data:`TARGETS` met."""
    out = []
    for r, ref in lean_against_vanilla(rows):
        ratios = {phase: _ratio(r[phase]['launches'], ref[phase]['launches'])
                  for phase in ('forward', 'backward', 'step')}
        ratios['bytes'] = _ratio(_moved(r['step']), _moved(ref['step']))
        out.append(dict(lean=r['row'], vanilla=ref['row'], ratios=ratios,
                        met={k: ratios[k] is not None and ratios[k] <= limit
                             for k, limit in TARGETS.items()}))
    return out


def _moved(phase: Dict) -> int:
    return phase['read_bytes'] + phase['written_bytes']


def _row(result: Dict, name: str) -> Dict:
    return next(r for r in result['rows'] if r['row'] == name)


def _cell(ratio: Optional[float], met: bool) -> str:
    return '' if ratio is None else f"{ratio:.2f}{'' if met else ' (no)'}"


def summary_table(results: Sequence[Dict]) -> str:
    """One line per lean row: launches and MiB moved, lean / vanilla, against
    targets."""
    headers = ('model', 'lean row', 'fwd', 'bwd', 'step', 'MiB moved',
               f"fwd ratio (<= {TARGETS['forward']})",
               f"step ratio (<= {TARGETS['step']})",
               f"bytes ratio (<= {TARGETS['bytes']})")
    body = []
    for res in results:
        for c in res['comparisons']:
            lean, ref = _row(res, c['lean']), _row(res, c['vanilla'])
            pair = ['{} / {}'.format(lean[p]['launches'], ref[p]['launches'])
                    for p in ('forward', 'backward', 'step')]
            body.append([res['label'], c['lean'], *pair,
                         f"{_moved(lean['step']) / MIB:.1f} / "
                         f"{_moved(ref['step']) / MIB:.1f}",
                         _cell(c['ratios']['forward'], c['met']['forward']),
                         _cell(c['ratios']['step'], c['met']['step']),
                         _cell(c['ratios']['bytes'], c['met']['bytes'])])
    return format_table(headers, body, align='ll' + 'r' * 7)


def kind_table(result: Dict) -> str:
    """One model's launches per kind, forward and backward, of every row."""
    rows = result['rows']
    kinds = [k for k in KINDS if any(
        r[p]['by_kind'].get(k) for r in rows for p in ('forward', 'backward'))]
    headers = ['kind'] + [f"{r['row']} {p}" for r in rows
                          for p in ('fwd', 'bwd')]
    body = [[k] + [r[p]['by_kind'].get(k, 0) for r in rows
                   for p in ('forward', 'backward')] for k in kinds]
    body.append(['optimizer'] + [v for r in rows
                                 for v in (r['optimizer']['launches'], '')])
    body.append(['total'] + [r[p]['launches'] for r in rows
                             for p in ('forward', 'backward')])
    return format_table(headers, body, align='l' + 'r' * (len(headers) - 1))


def time_table(result: Dict, top: int = 8) -> str:
    """A GPU-recorded model: host wall time next to device busy time, and top
    kernels."""
    headers = ('row', 'phase', 'kernels', 'host ms', 'GPU busy ms',
               'busy / host')
    body = []
    for r in result['rows']:
        for p in ('forward', 'backward', 'optimizer', 'step'):
            host, busy = r[p]['host_us'], r[p]['gpu_us']
            body.append([r['row'], p, r[p]['launches'], f'{host / 1e3:.2f}',
                         f'{busy / 1e3:.2f}',
                         f'{busy / host:.2f}' if host else ''])
    text = [format_table(headers, body, align='llrrrr'), '']
    for r in result['rows']:
        kernels = list(r['step']['time_by_op'].items())[:top]
        text += [f"{r['row']}: longest kernels of the step\n",
                 format_table(('kernel', 'launches', 'GPU ms'), [
                     [name[:90], r['step']['by_op'].get(name, 0),
                      f'{us / 1e3:.3f}'] for name, us in kernels],
                     align='lrr'), '']
    return '\n'.join(text)


def write_results(results: Sequence[Dict], out_dir: str) -> None:
    """``launches.json`` and ``launches.md`` in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(osp.join(out_dir, 'launches.json'), list(results))
    with open(osp.join(out_dir, 'launches.md'), 'w') as f:
        f.write(_markdown(results))


def _markdown(results: Sequence[Dict]) -> str:
    first = results[0]
    where = (f"recorded on {first['gpu']} by torch.profiler (bytes not "
             "recorded)" if first.get('gpu') else 'counted on a CPU')
    text = [f"Launches on the CUDA path ({where}), lean / "
            f"vanilla-same-layers; crop {first['crop'][0]}x"
            f"{first['crop'][1]}, batch {first['batch']}, torch "
            f"{first['torch']}, triton {first['triton']}\n",
            summary_table(results), '']
    for res in results:
        text += [f"## {res['label']}: launches per kind\n", kind_table(res),
                 '']
        if res.get('gpu'):
            text += [f"## {res['label']}: where the step's time goes\n",
                     time_table(res), '']
    return '\n'.join(text) + '\n'


def run_jobs(jobs: Sequence[Job], batch: int, out_dir: str,
             triton: bool = True, run_kernels: bool = False,
             device: str = 'cpu') -> List[Dict]:
    """Count every job's rows, print the tables and write the results after
    each model."""
    results = []
    for job in jobs:
        results.append(count_model(job, batch, triton, run_kernels,
                                   progress=lambda m: print(m, flush=True),
                                   device=device))
        if torch.device(device).type == 'cuda':
            results[-1]['gpu'] = torch.cuda.get_device_name(device)
        print(f"\n{kind_table(results[-1])}\n", flush=True)
        write_results(results, out_dir)
    print(summary_table(results))
    return results
