"""The host-time measurements' tables and report files
(:mod:`.host_time` measures; ``tools/count_launches.py --host-time`` runs
this)."""
import os
import os.path as osp
import sys
from typing import Dict, List, Sequence

from ..accounting.format import format_table
from ..engine.tool_args import write_json
from .host_time import TARGETS, host_time_model
from .step_jobs import Job

__all__ = ['step_table', 'layer_table', 'decisions_line', 'run_host_jobs']


def _ms(us: float) -> str:
    return f'{us / 1e3:.2f}'


def step_table(results: Sequence[Dict]) -> str:
    """One line per lean row: host time per step (ms, medians), lean and
    vanilla-same-layers, by phase, and the step's ratio."""
    headers = ('model', 'lean row', 'lean host ms', 'vanilla host ms',
               'fwd', 'bwd', 'opt', 'lean wall ms', 'vanilla wall ms',
               f"host ratio (<= {TARGETS['step']})")
    body = []
    for res in results:
        rows = {r['row']: r for r in res['rows']}
        for c in res['comparisons']:
            lean, ref = rows[c['lean']], rows[c['vanilla']]
            by_phase = [
                f"{_ms(lean['phases'].get(p, {}).get('host_us', 0))} / "
                f"{_ms(ref['phases'].get(p, {}).get('host_us', 0))}"
                for p in ('forward', 'backward', 'optimizer')]
            body.append([res['label'], c['lean'],
                         _ms(lean['step']['host_us']),
                         _ms(ref['step']['host_us']), *by_phase,
                         _ms(lean['step']['wall_us']),
                         _ms(ref['step']['wall_us']),
                         f"{c['ratio']:.2f}{'' if c['met'] else ' (no)'}"])
    return format_table(headers, body, align='ll' + 'r' * 8)


def layer_table(result: Dict) -> str:
    """One model's kinds: host time per call (us, forward and backward,
    kinds called inside included), lean and vanilla, and the difference
    against :data:`TARGETS`."""
    headers = ('kind', 'calls', 'lean us/call', 'vanilla us/call',
               f"overhead us (<= {TARGETS['layer_us']:.0f})")
    body = []
    for c in result['comparisons']:
        for v in c['layers']:
            body.append([v['kind'], int(v['calls']), f"{v['lean_us']:.0f}",
                         f"{v['vanilla_us']:.0f}",
                         f"{v['overhead_us']:+.0f}"
                         f"{'' if v['met'] else ' (no)'}"])
    return format_table(headers, body, align='lrrrr')


def decisions_line(result: Dict) -> str:
    """What the profiled steps decided anew (none: every call's choice,
    geometry and plan was kept from the warm-up)."""
    decided = result['rows'][0]['decided']
    return (f"Decided in the {result['steps']} profiled steps of "
            f"{len(result['rows'])} rows: {decided['dispatch_misses']} "
            f"dispatcher choices, {decided['plans_made']} call plans.")


def run_host_jobs(jobs: Sequence[Job], batch: int, out_dir: str,
                  steps: int = 20, warmup: int = 3,
                  triton: bool = True) -> List[Dict]:
    """Measure every job's rows, print the tables and write
    ``host_time.json`` and ``host_time.md`` to ``out_dir`` (after each
    model)."""
    results = []
    for job in jobs:
        results.append(host_time_model(
            job, batch, steps, warmup, triton,
            progress=lambda m: print(m, flush=True)))
        print(f"\n{layer_table(results[-1])}\n\n"
              f"{decisions_line(results[-1])}\n", flush=True)
        os.makedirs(out_dir, exist_ok=True)
        write_json(osp.join(out_dir, 'host_time.json'), results)
        with open(osp.join(out_dir, 'host_time.md'), 'w') as f:
            f.write(_markdown(results))
    print(step_table(results), file=sys.stdout)
    return results


def _markdown(results: Sequence[Dict]) -> str:
    first = results[0]
    text = [f"Host time outside ATen per step on the CUDA path (counted on "
            f"a CPU, Triton launches stubbed), lean / vanilla-same-layers; "
            f"crop {first['crop'][0]}x{first['crop'][1]}, batch "
            f"{first['batch']}, {first['threads']} thread(s), medians of "
            f"{first['steps']} steps, torch {first['torch']}\n",
            step_table(results), '']
    for res in results:
        text += [f"## {res['label']}: host time per call, by kind\n",
                 layer_table(res), '', decisions_line(res), '']
    return '\n'.join(text) + '\n'
