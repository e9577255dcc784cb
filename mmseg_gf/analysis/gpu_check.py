"""The stages of one GPU check (``tools/gpu_check.py``, ``make gpu-check``)
and the files they leave.

The stages (:data:`STAGES`: ``tests``, ``steps``, ``launches``,
``compiled``, ``layers``) run the project's own tools one after the other
in their own processes, each within its share of a time budget, so that a
stage that fails or hangs costs its share and no more. :func:`write_results`
gathers what they wrote into at most 8 files for :mod:`.gpu_report`.
"""
import importlib.util
import json
import os
import os.path as osp
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from .gpu_report import (LayerRun, launch_checks, layer_checks,
                         layer_runs_table, step_checks, summary_markdown)

__all__ = ['STAGES', 'stage_commands', 'check_commands', 'environment',
           'Runner', 'run_stages', 'write_results']

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))

#: Stages in the order they run, each with its share of the budget (the
#: last one takes what is left). Sized on one H200 at the default 600 s:
#: there the CUDA tests took more than 98 s (8 workers), the two step runs
#: 33 + 49 s, a kernel recording more than 20 s per model, the compiled
#: step more than 67 s (Inductor in the warm-up rounds) and the first
#: layer run more than 36 s (its Triton kernels compiled).
STAGES = (('tests', 0.23), ('steps', 0.15), ('launches', 0.13),
          ('compiled', 0.25), ('layers', 1.0))
#: (flag, names, rows) of the step runs: the protocol's PSPNet-R18 last 10
#: and three families at N = 20 (conv and Linear layers counted).
STEP_RUNS = (('models', ('pspnet_r18', ), ('inference', 'vanilla_last10:plain',
                                           'gf_last10_r4:lean')),
             ('families', ('bisenetv2', 'segformer_b0', 'swin_t'),
              ('inference', 'vanilla_last20:plain', 'gf_last20_r4:lean')))
#: The layer runs: (batch, dtype, Triton kernels, layer kinds).
LAYER_RUNS = ((32, 'float32', True, ('conv', 'linear')),
              (8, 'float32', True, ('conv', 'linear')),
              (32, 'float32', False, ('conv', )))
QUICK_LAYER_RUNS = ((1, 'float32', True, ('conv', 'linear')),
                    (1, 'float32', False, ('conv', )))
#: What ``torch.compile`` measures: PSPNet-R18's rows, CUDA graphs.
COMPILE_MODE = 'reduce-overhead'
GOLDEN_LAUNCHES = osp.join(REPO, 'tests', 'golden', 'launches_64.json')


def _tool(name: str) -> List[str]:
    return [sys.executable, f'tools/{name}.py']


def _test_command(args) -> List[str]:
    argv = [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-rfE',
            '--tb=short']
    if args.quick:
        argv += ['tests/test_ops/conv/test_gf_op.py', '-q', '-k',
                 'nan_in_output_grad']
    else:
        argv += ['tests', '-m', 'cuda', '-v']
    if args.test_workers > 0:
        argv += ['-n', str(args.test_workers), '--dist', 'load']
    return argv


def _runs(args):
    """:data:`STEP_RUNS`; with ``--quick`` the first alone."""
    return STEP_RUNS[:1] if args.quick else STEP_RUNS


def _step_commands(args) -> List[dict]:
    out = []
    for flag, names, rows in _runs(args):
        if args.quick:  # tiny
            size = ['--crop', '64', '--batch', '1', '--repeats', '1',
                    '--warmup', '0', '--threads', '1']
        else:
            size = ['--crop', '512', '--batch', '8', '--repeats', '3',
                    '--warmup', '1']
        out_dir = osp.join(args.work, f'steps_{flag}')
        out.append(dict(
            argv=_tool('benchmark_step') + [
                '--device', args.device, f'--{flag}', *names, *size,
                '--rows', *rows, '--out-dir', out_dir],
            out=out_dir, name=f'steps ({flag})'))
    return out


def _launch_commands(args) -> List[dict]:
    """The kernels of the step runs' training rows at the golden file's
    size."""
    out = []
    for flag, names, rows in _runs(args):
        out_dir = osp.join(args.work, f'launches_{flag}')
        out.append(dict(
            argv=_tool('count_launches') + [
                '--device', args.device, f'--{flag}', *names,
                '--input-size', '64', '--batch', '1', '--rows',
                *[r for r in rows if r != 'inference'], '--out-dir',
                out_dir] + (['--no-triton'] if args.device == 'cpu' else []),
            out=out_dir, name=f'launches ({flag})'))
    return out


def _compiled_commands(args) -> List[dict]:
    """None with ``--quick`` (Inductor takes minutes on a CPU)."""
    if args.quick:
        return []
    flag, names, rows = STEP_RUNS[0]
    out_dir = osp.join(args.work, 'steps_compiled')
    return [dict(argv=_tool('benchmark_step') + [
        '--device', args.device, f'--{flag}', *names, '--crop', '512',
        '--batch', '8', '--repeats', '3', '--warmup', '2', '--no-memory',
        '--compile', COMPILE_MODE, '--rows', *rows, '--out-dir', out_dir],
        out=out_dir, name=f'steps compiled ({COMPILE_MODE})')]


def _layer_commands(args) -> List[dict]:
    out = []
    for batch, dtype, triton, kinds in (QUICK_LAYER_RUNS if args.quick
                                        else LAYER_RUNS):
        out_dir = osp.join(args.work, f'layers_b{batch}_{dtype}_'
                           f"{'triton' if triton else 'no_triton'}")
        argv = _tool('benchmark_layers') + [
            '--devices', args.device, '--batch', str(batch), '--dtype',
            dtype, '--kinds', *kinds, '--out-dir', out_dir]
        if args.quick:
            argv += ['--layers', '4', '--linear-layers', '1', '--repeats',
                     '1', '--warmup', '0', '--threads', '1']
        if not triton:
            argv.append('--no-triton')
        out.append(dict(argv=argv, batch=batch, dtype=dtype, triton=triton,
                        out=out_dir, name=f"layers batch {batch} {dtype} "
                        f"{'triton' if triton else 'no-triton'}"))
    return out


def stage_commands(args) -> Dict[str, List[dict]]:
    """Every command of every stage, each a dict with ``argv``, ``name`` and
    ``out``."""
    return dict(tests=[dict(argv=_test_command(args), name='tests')],
                steps=_step_commands(args),
                launches=_launch_commands(args),
                compiled=_compiled_commands(args),
                layers=_layer_commands(args))


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(
        f'gf_tool_{name}', osp.join(REPO, 'tools', f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_commands(commands: Dict[str, List[dict]]) -> None:
    """Parse every tool command with its tool's parser, before any GPU time is
    spent."""
    for stage, items in commands.items():
        if stage == 'tests':
            continue
        for command in items:
            tool = _load_tool(osp.splitext(osp.basename(
                command['argv'][1]))[0])
            tool.parse_args(command['argv'][2:])


def environment(device: str) -> Dict[str, str]:
    """The stack the check ran on."""
    env = dict(python=platform.python_version(), torch=torch.__version__,
               cpu_threads=str(torch.get_num_threads()))
    try:
        import triton
        env['triton'] = triton.__version__
    except ImportError:
        env['triton'] = 'not installed'
    if device == 'cuda':
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=f'{props.name}, {props.total_memory / 2**30:.0f} GiB',
            cuda=str(torch.version.cuda),
            cudnn=str(torch.backends.cudnn.version()),
            tf32=(f'cuDNN convolutions {torch.backends.cudnn.allow_tf32}, '
                  'cuBLAS products '
                  f'{torch.backends.cuda.matmul.allow_tf32} (torch\'s '
                  'defaults, used by every benchmark)'),
            cudnn_benchmark='on in the layer benchmark (vanilla)')
    try:
        env['commit'] = subprocess.run(
            ['git', 'describe', '--always', '--dirty'], cwd=REPO,
            capture_output=True, text=True, timeout=10).stdout.strip() or '?'
    except (OSError, subprocess.SubprocessError):
        env['commit'] = '?'
    return env


class Runner:
    """Runs commands one after the other within a deadline, logging each."""

    def __init__(self, log_path: str, budget_s: float) -> None:
        self.log_path = log_path
        self.deadline = time.monotonic() + budget_s
        self.stages: List[Dict] = []

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, argv: Sequence[str],
            seconds: float) -> bool:
        """Run ``argv`` for at most ``seconds``; returns whether it exited with
        status 0."""
        limit = min(self.remaining(), seconds)
        if limit < 5:
            self.stages.append(dict(name=name, outcome='not run: no time '
                                    'left', seconds=0.0))
            print(f'[gpu-check] {name}: not run, no time left', flush=True)
            return False
        env = dict(os.environ)
        env['PYTHONPATH'] = os.pathsep.join(
            p for p in (REPO, env.get('PYTHONPATH')) if p)
        start = time.monotonic()
        print(f'[gpu-check] {name} (at most {limit:.0f} s)', flush=True)
        with open(self.log_path, 'a') as log:
            log.write(f'\n===== {name}\n$ {" ".join(argv)}\n')
            log.flush()
            try:
                status = subprocess.run(argv, cwd=REPO, env=env, stdout=log,
                                        stderr=subprocess.STDOUT,
                                        timeout=limit).returncode
                outcome = 'ok' if status == 0 else f'failed (status {status})'
            except subprocess.TimeoutExpired:
                status, outcome = None, f'stopped after {limit:.0f} s'
            seconds = time.monotonic() - start
            log.write(f'===== {name}: {outcome}, {seconds:.1f} s\n')
        self.stages.append(dict(name=name, outcome=outcome, seconds=seconds))
        print(f'[gpu-check] {name}: {outcome}, {seconds:.0f} s', flush=True)
        return status == 0


def run_stages(runner: Runner, commands: Dict[str, List[dict]],
               budget_s: float) -> bool:
    """Every stage within its share of ``budget_s``; whether all exited with
    status 0."""
    ok = True
    for stage, share in STAGES:
        items = commands[stage]
        stage_end = time.monotonic() + min(share * budget_s,
                                           runner.remaining())
        for i, command in enumerate(items):
            left = (stage_end - time.monotonic()) / (len(items) - i)
            ok &= runner.run(command['name'], command['argv'], left)
    return ok


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _gather_steps(commands: Dict[str, List[dict]]):
    results, tables = [], []
    for command in commands['steps'] + commands['compiled']:
        results += _read_json(osp.join(command['out'], 'steps.json')) or []
        tables.append(_read_text(osp.join(command['out'], 'steps.md'))
                      or f"(no result: `{' '.join(command['argv'][1:])}`)")
    return results, tables


def _gather_launches(commands: Dict[str, List[dict]]):
    results, tables = [], []
    for command in commands['launches']:
        results += _read_json(osp.join(command['out'],
                                       'launches.json')) or []
        tables.append(_read_text(osp.join(command['out'], 'launches.md'))
                      or f"(no result: `{' '.join(command['argv'][1:])}`)")
    return results, tables


def write_results(out_dir: str, commands: Dict[str, List[dict]],
                  runner: Runner, env: Dict[str, str]) -> List[str]:
    """The stages' files gathered into ``out_dir``; returns the files
    written."""
    runs = [LayerRun(c['batch'], c['dtype'], c['triton'],
                     ' '.join(c['argv'][1:]),
                     _read_json(osp.join(c['out'], 'layers.json')))
            for c in commands['layers']]
    steps, step_tables = _gather_steps(commands)
    launches, launch_tables = _gather_launches(commands)
    golden = (_read_json(GOLDEN_LAUNCHES) or {}).get('counts', {})
    files = {
        'layers.json': json.dumps(dict(runs=[dict(
            batch=r.batch, dtype=r.dtype, triton=r.triton,
            command=r.command, result=r.result) for r in runs]), indent=2),
        'layers.md': '# Layer benchmark runs\n\nBackward speedup over '
        "vanilla (cuDNN's conv, cuBLAS's Linear on CUDA) with g_x, per run "
        f'and layer kind:\n\n{layer_runs_table(runs)}\n' + ''.join(
            f"\n## {run.name}\n\n`{run.command}`\n\n"
            f"{_read_text(osp.join(c['out'], 'layers.md')) or '(no result)'}"
            '\n' for c, run in zip(commands['layers'], runs)),
        'steps.json': json.dumps(steps, indent=2),
        'steps.md': '# Step benchmark runs\n\n' + '\n\n'.join(
            f"`{' '.join(c['argv'][1:])}`\n\n{table}" for c, table in zip(
                commands['steps'] + commands['compiled'], step_tables)) +
        '\n',
        'launches.json': json.dumps(launches, indent=2),
        'launches.md': '# Kernels recorded per step\n\n' + '\n\n'.join(
            launch_tables) + '\n',
        'summary.md': summary_markdown(
            env, layer_checks(runs) + step_checks(steps) +
            launch_checks(launches, golden), runner.stages,
            launch_comparison=(launches, golden)),
    }
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in files.items():
        written.append(osp.join(out_dir, name))
        with open(written[-1], 'w') as f:
            f.write(text)
    return written
