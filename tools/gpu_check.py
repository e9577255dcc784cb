"""Check the project on one CUDA GPU in one command (about 8 minutes).

Runs, each in its own process, within a time budget:

1. the CUDA tests (``pytest -m cuda``: every test's CUDA variant, the
   Triton kernels compiled, CUDA graphs, the filtered Linear and the
   transformer blocks' lean modules);
2. ``tools/benchmark_layers.py --device cuda`` at batch 32 and 8: the
   paper's 3x3 convs (float32 and bfloat16, with the Triton kernels and
   with ``--no-triton``, each against cuDNN's backward, ``cudnn.benchmark``
   on) and, in the Triton runs, the transformer Linears on token grids
   (against cuBLAS); TF32 as torch's defaults, recorded;
3. ``tools/benchmark_step.py --device cuda`` for one protocol model, one
   real-time family and two transformer families at 512x512, batch 8:
   inference, vanilla last N ``lean=False`` and GF last N lean (time,
   ``max_memory_allocated``);

then writes at most 8 files to ``--out-dir``: ``summary.md`` (the stack,
each stage's outcome, every target with what was measured),
``gpu_check.log`` (every command and its whole output), ``layers.json`` /
``layers.md`` / ``layers.png`` (all layer runs) and ``steps.json`` /
``steps.md`` / ``steps.png``. Without a CUDA GPU it says so and exits at
once with status 3, writing nothing.

Examples::

    make gpu-check OUT=work_dirs/gpu_check            # python3 on PATH
    python tools/gpu_check.py --out-dir work_dirs/gpu_check
    python tools/gpu_check.py --dry-run               # the commands only
    python tools/gpu_check.py --device cpu --quick --out-dir /tmp/gc
                                                      # the plumbing, on CPU

Exit status: 0 when every stage ran to its end (targets may still be
missed: see ``summary.md``), 1 when a stage failed or ran out of time, 3
without CUDA.
"""
import argparse
import json
import os
import os.path as osp
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
NO_CUDA_STATUS = 3

#: The step benchmark's runs: a protocol model with the protocol's
#: strategies, then a real-time family and two transformer families
#: (Segformer-B0 is both), whose GF rows count conv and Linear layers (at
#: N = 20 Swin-T's last blocks are trained).
STEP_MODELS = ('pspnet_r18', )
STEP_MODEL_ROWS = ('inference', 'vanilla_last5:plain', 'gf_last5_r4:lean',
                   'vanilla_last10:plain', 'gf_last10_r4:lean')
STEP_FAMILIES = ('bisenetv2', 'segformer_b0', 'swin_t')
STEP_FAMILY_ROWS = ('inference', 'vanilla_last10:plain',
                    'gf_last10_r4:lean', 'vanilla_last20:plain',
                    'gf_last20_r4:lean')
#: The layer runs: (batch, dtype, Triton kernels, layer kinds). The
#: Linear layers take no Triton kernel, so they run once per batch and
#: dtype, in the Triton runs.
LAYER_RUNS = ((32, 'float32', True, ('conv', 'linear')),
              (32, 'float32', False, ('conv', )),
              (8, 'float32', True, ('conv', 'linear')),
              (8, 'float32', False, ('conv', )),
              (32, 'bfloat16', True, ('conv', 'linear')),
              (8, 'bfloat16', True, ('conv', )))
QUICK_LAYER_RUNS = ((1, 'float32', True, ('conv', 'linear')),
                    (1, 'float32', False, ('conv', )))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out-dir', default='work_dirs/gpu_check')
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'],
                   help="'cpu' runs the same stages on the CPU (with "
                   "--quick: tiny settings), to try the command itself")
    p.add_argument('--quick', action='store_true',
                   help='tiny settings: a few tests, one small layer at '
                   'batch 1, one protocol model at 64x64')
    p.add_argument('--dry-run', action='store_true',
                   help='print the commands (their arguments checked by '
                   'the tools\' own parsers) and run nothing')
    p.add_argument('--budget-s', type=float, default=450.0,
                   help='seconds for all stages together (default 450: '
                   'under 8 minutes with the set-up)')
    p.add_argument('--test-workers', type=int, default=6,
                   help='pytest-xdist workers for the CUDA tests, tests '
                   'spread one by one (0: one process)')
    return p.parse_args(argv)


def stage_commands(args) -> Dict[str, List[dict]]:
    """Every command of every stage: ``{'tests': [...], 'layers': [...],
    'steps': [...]}``, each a dict with ``argv`` and, for the layer runs,
    ``batch`` / ``dtype`` / ``triton`` / ``out``; ``out`` directories lie
    under ``args.work``."""
    py, work = sys.executable, args.work
    tests = [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rs']
    if args.quick:
        tests += ['tests/test_ops/test_gf_op.py', '-k', 'nan_in_output_grad']
    else:
        tests += ['tests', '-m', 'cuda']
    if args.test_workers > 0:
        tests += ['-n', str(args.test_workers), '--dist', 'load']
    layer_runs = []
    for batch, dtype, triton, kinds in (QUICK_LAYER_RUNS if args.quick
                                        else LAYER_RUNS):
        out = osp.join(work, f'layers_b{batch}_{dtype}_'
                       f"{'triton' if triton else 'no_triton'}")
        argv = [py, 'tools/benchmark_layers.py', '--devices', args.device,
                '--batch', str(batch), '--dtype', dtype, '--kinds', *kinds,
                '--out-dir', out]
        if args.quick:
            argv += ['--layers', '4', '--linear-layers', '1', '--repeats',
                     '1', '--warmup', '0', '--threads', '1']
        if not triton:
            argv.append('--no-triton')
        layer_runs.append(dict(argv=argv, batch=batch, dtype=dtype,
                               triton=triton, out=out))
    steps = []
    for which, names, rows in (('models', STEP_MODELS, STEP_MODEL_ROWS),
                               ('families', STEP_FAMILIES,
                                STEP_FAMILY_ROWS)):
        out = osp.join(work, f'steps_{which}')
        argv = [py, 'tools/benchmark_step.py', '--device', args.device,
                '--out-dir', out, f'--{which}']
        if args.quick:
            argv += [names[0], '--crop', '64', '--batch', '1', '--repeats',
                     '1', '--warmup', '0', '--threads', '1', '--rows',
                     *rows[:3]]
        else:
            argv += [*names, '--crop', '512', '--batch', '8', '--repeats',
                     '3', '--warmup', '1', '--rows', *rows]
        steps.append(dict(argv=argv, out=out, name=f'steps ({which})'))
    return dict(tests=[dict(argv=tests)], layers=layer_runs, steps=steps)


def _load_tool(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        f'gf_tool_{name}', osp.join(REPO, 'tools', f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_commands(commands: Dict[str, List[dict]]) -> None:
    """Parse every benchmark command with its tool's own parser (a bad
    argument fails here, before any GPU time is spent)."""
    for stage in ('layers', 'steps'):
        for command in commands[stage]:
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
    """Runs commands one after the other within a deadline, appending each
    command and its whole output to the log."""

    def __init__(self, log_path: str, budget_s: float) -> None:
        self.log_path = log_path
        self.deadline = time.monotonic() + budget_s
        self.stages: List[Dict] = []

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, argv: Sequence[str], share: float = 1.0,
            seconds: Optional[float] = None) -> bool:
        """Run ``argv`` with at most ``share`` of the remaining time (or
        ``seconds``, within it); record the outcome. Returns whether it
        exited with status 0."""
        limit = self.remaining() * share
        if seconds is not None:
            limit = min(limit, seconds)
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


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_results(out_dir: str, commands: Dict[str, List[dict]],
                  runner: Runner, env: Dict[str, str]) -> List[str]:
    """The layer runs gathered, the step files copied, the summary;
    returns the files written."""
    from mmseg_gf.analysis.gpu_report import (LayerRun, layer_checks,
                                              layer_runs_table,
                                              plot_layer_runs, step_checks,
                                              summary_markdown)
    from mmseg_gf.analysis.step_benchmark import plot
    runs = [LayerRun(c['batch'], c['dtype'], c['triton'],
                     ' '.join(c['argv'][1:]),
                     _read_json(osp.join(c['out'], 'layers.json')))
            for c in commands['layers']]
    written = []

    def path(name):
        written.append(osp.join(out_dir, name))
        return written[-1]

    with open(path('layers.json'), 'w') as f:
        json.dump(dict(runs=[dict(batch=r.batch, dtype=r.dtype,
                                  triton=r.triton, command=r.command,
                                  result=r.result) for r in runs]),
                  f, indent=2)
    with open(path('layers.md'), 'w') as f:
        f.write('# Layer benchmark runs\n\nBackward speedup over vanilla '
                '(cuDNN\'s conv, cuBLAS\'s Linear on CUDA) with g_x, per '
                'run and layer kind:\n\n'
                f'{layer_runs_table(runs)}\n')
        for c, run in zip(commands['layers'], runs):
            table = _read_text(osp.join(c['out'], 'layers.md'))
            f.write(f'\n## {run.name}\n\n`{run.command}`\n\n'
                    f'{table or "(no result)"}\n')
    if not plot_layer_runs(runs, path('layers.png')):
        written.pop()
    step_results, step_tables = [], []
    for command in commands['steps']:
        step_results += _read_json(osp.join(command['out'],
                                            'steps.json')) or []
        step_tables.append(_read_text(osp.join(command['out'], 'steps.md'))
                           or f"(no result: `{' '.join(command['argv'][1:])}`)")
    if step_results:
        with open(path('steps.json'), 'w') as f:
            json.dump(step_results, f, indent=2)
        if not plot(step_results, path('steps.png')):
            written.pop()
    with open(path('steps.md'), 'w') as f:
        f.write('# Step benchmark runs\n\n' + '\n\n'.join(
            f"`{' '.join(c['argv'][1:])}`\n\n{table}"
            for c, table in zip(commands['steps'], step_tables)) + '\n')
    checks = layer_checks(runs) + step_checks(step_results)
    with open(path('summary.md'), 'w') as f:
        f.write(summary_markdown(env, checks, runner.stages))
    return written


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        print(f'gpu-check: no CUDA GPU is available (torch '
              f'{torch.__version__}, torch.cuda.is_available() is False); '
              'nothing was run. On a CPU-only machine, try the command '
              'itself with --device cpu --quick.', file=sys.stderr)
        return NO_CUDA_STATUS
    args.work = tempfile.mkdtemp(prefix='gpu_check_')
    try:
        commands = stage_commands(args)
        check_commands(commands)
        if args.dry_run:
            for stage, items in commands.items():
                for command in items:
                    print(f'[{stage}] {" ".join(command["argv"])}')
            return 0
        return _run(args, commands)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


def _run(args, commands) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    log_path = osp.join(args.out_dir, 'gpu_check.log')
    env = environment(args.device)
    with open(log_path, 'w') as log:
        log.write('gpu-check\n' + ''.join(f'{k}: {v}\n'
                                          for k, v in env.items()))
    print('[gpu-check] ' + ', '.join(f'{k} {v}' for k, v in env.items()),
          flush=True)
    runner = Runner(log_path, args.budget_s)
    ok = runner.run('tests', commands['tests'][0]['argv'], share=0.35)
    # The layer runs share half of what is left, the steps the rest. Each
    # layer run may take half of what the layer runs have left (the last
    # one all of it): the first one compiles the Triton kernels, the
    # others find them in Triton's cache.
    layers = commands['layers']
    layers_end = time.monotonic() + 0.5 * runner.remaining()
    for i, command in enumerate(layers):
        name = (f"layers batch {command['batch']} {command['dtype']} "
                f"{'triton' if command['triton'] else 'no-triton'}")
        left = layers_end - time.monotonic()
        ok &= runner.run(name, command['argv'], seconds=left if i == len(
            layers) - 1 else 0.5 * left)
    steps = commands['steps']
    for i, command in enumerate(steps):
        ok &= runner.run(command['name'], command['argv'],
                         share=1.0 / (len(steps) - i))
    written = write_results(args.out_dir, commands, runner, env)
    print(f'[gpu-check] wrote {", ".join(sorted(written + [log_path]))}')
    print(_read_text(osp.join(args.out_dir, 'summary.md')))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
