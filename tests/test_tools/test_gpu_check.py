"""tools/gpu_check.py (``make gpu-check``): without CUDA it stops at once;
``--dry-run`` lists every command, checked by the tools' own parsers; on
the CPU with ``--quick`` the whole pipeline runs with tiny settings and
writes its files; the report reads targets from the benchmarks' files
(:mod:`mmseg_gf.analysis.gpu_report`)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.analysis.gpu_report import (LayerRun,  # noqa: E402
                                          launch_checks, launch_table,
                                          layer_checks, layer_runs_table,
                                          step_checks)
from tests.helpers.tools import REPO, load_tool  # noqa: E402

gpu_check = load_tool('gpu_check')


@pytest.mark.skipif(torch.cuda.is_available(), reason='a CUDA machine')
def test_without_cuda_it_says_so_and_stops_at_once(tmp_path):
    out = tmp_path / 'out'
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, 'tools/gpu_check.py', '--out-dir', str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == gpu_check.NO_CUDA_STATUS, proc.stderr
    assert 'no CUDA GPU is available' in proc.stderr
    assert time.monotonic() - start < 60  # an import of torch, no more
    assert not out.exists()


def test_dry_run_lists_every_command(capsys):
    assert gpu_check.main(['--device', 'cpu', '--dry-run']) == 0
    lines = capsys.readouterr().out.splitlines()
    stages = [line.split(']')[0][1:] for line in lines]
    assert stages == ['tests', 'steps', 'steps', 'launches', 'launches',
                      'compiled', 'layers', 'layers', 'layers']
    assert '-m cuda' in lines[0]
    layers = [line for line in lines if line.startswith('[layers]')]
    assert sum('--no-triton' in line for line in layers) == 1
    assert sum('--kinds conv linear' in line for line in layers) == 2
    for option in ('--batch 32', '--batch 8'):
        assert any(option in line for line in layers), option
    models, families = [line for line in lines
                        if line.startswith('[steps]')]
    for option in ('--crop 512', '--batch 8', '--models pspnet_r18',
                   'vanilla_last10:plain', 'gf_last10_r4:lean'):
        assert option in models, option
    for option in ('--crop 512', '--batch 8',
                   '--families bisenetv2 segformer_b0 swin_t',
                   'vanilla_last20:plain', 'gf_last20_r4:lean'):
        assert option in families, option
    # the launch rows are the golden file's (64x64, batch 1)
    launches = [line for line in lines if line.startswith('[launches]')]
    assert all('--input-size 64 --batch 1' in line for line in launches)
    assert 'inference' not in ' '.join(launches)
    compiled = next(line for line in lines if line.startswith('[compiled]'))
    assert '--compile reduce-overhead' in compiled
    assert '--warmup 2' in compiled


def test_quick_run_on_the_cpu_writes_its_files(tmp_path, capsys):
    status = gpu_check.main(['--device', 'cpu', '--quick', '--out-dir',
                             str(tmp_path), '--test-workers', '0',
                             '--budget-s', '900'])
    files = sorted(p.name for p in tmp_path.iterdir())
    log = (tmp_path / 'gpu_check.log').read_text()
    assert status == 0, log[-3000:]
    assert files == sorted(['summary.md', 'gpu_check.log', 'layers.json',
                            'layers.md', 'steps.json', 'steps.md',
                            'launches.json', 'launches.md'])
    runs = json.loads((tmp_path / 'layers.json').read_text())['runs']
    assert [r['triton'] for r in runs] == [True, False]
    assert all(r['result']['rows'] for r in runs)
    kinds = [{row['kind'] for row in r['result']['rows']} for r in runs]
    assert kinds == [{'conv', 'linear'}, {'conv'}]
    table = (tmp_path / 'layers.md').read_text()
    assert '| linear |' in table and '| conv |' in table
    steps = json.loads((tmp_path / 'steps.json').read_text())
    assert [(s['model'], s['compile']) for s in steps] == [
        ('pspnet_r18', None)]
    launches = json.loads((tmp_path / 'launches.json').read_text())
    assert [r['model'] for r in launches] == ['pspnet_r18']
    summary = (tmp_path / 'summary.md').read_text()
    for stage in ('tests', 'steps (models)', 'launches (models)'):
        assert f'| {stage} | ok |' in summary, stage
    # batch 1 on the CPU: the batch-32 / 8 layer targets have no figure
    assert 'not measured' in summary
    assert 'PSPNet-R18 gf_last10_r4:lean: step peak' in summary
    assert 'PSPNet-R18 gf_last10_r4:lean, kernels recorded: forward' \
        in summary
    # the CPU's count (kernels off, --no-triton) against the golden file's
    # Triton count: the vanilla rows are the same operators
    assert '| PSPNet-R18 | vanilla_last10:plain | 119 / 119 |' in summary


def _run(batch, triton, speedups, dtype='float32', linear=None):
    rows = [dict(case='with_gx', radius=r, layer=f'L{i}', kind='conv',
                 backward_speedup=s)
            for r, values in speedups.items() for i, s in enumerate(values)]
    rows += [dict(case='with_gx', radius=r, layer=f'linear L{i}',
                  kind='linear', backward_speedup=s)
             for r, values in (linear or {}).items()
             for i, s in enumerate(values)]
    return LayerRun(batch, dtype, triton, 'cmd', dict(rows=rows))


def test_linear_rows_stay_out_of_the_conv_targets():
    """The conv targets read the conv rows alone; the table gives each
    kind its own line."""
    run = _run(32, True, {2: [9.0, 11.0, 12.0]},
               linear={2: [0.5, 0.5, 0.5, 0.5]})
    checks = {c.target: c for c in layer_checks([run])}
    r2 = checks['batch 32, float32, r = 2: median backward speedup over '
                'cuDNN with g_x >= 2x']
    assert (r2.measured, r2.holds) == ('11.0x', True)
    linear = checks['batch 32, float32, r = 4: every Linear >= 1.5x cuBLAS '
                    '(with g_x)']
    assert linear.holds is None  # no Linear measured at r = 4
    assert run.kinds() == ['conv', 'linear']
    lines = layer_runs_table([run]).splitlines()
    conv = next(line for line in lines if '| conv |' in line)
    linear = next(line for line in lines if '| linear |' in line)
    assert '11.0x' in conv and '9.00x' in conv
    assert '0.5x' in linear and '0.50x' in linear


def test_layer_targets_read_the_triton_runs():
    runs = [_run(32, True, {2: [1.0, 2.5, 12.0], 4: [30.0, 2.6, 2.0]},
                 linear={4: [1.6, 1.4]}),
            _run(32, False, {2: [9.0] * 3, 4: [9.0] * 3}),
            _run(8, True, {2: [3.0, 0.9], 4: [2.0, 1.5]}),
            LayerRun(8, 'bfloat16', True, 'cmd', None)]
    checks = {c.target: c for c in layer_checks(runs)}
    r2 = checks['batch 32, float32, r = 2: median backward speedup over '
                'cuDNN with g_x >= 2x']
    assert (r2.measured, r2.holds) == ('2.5x', True)
    r4 = checks['batch 32, float32, r = 4: median backward speedup over '
                'cuDNN with g_x >= 3x']
    assert (r4.measured, r4.holds) == ('2.6x', False)
    linear = checks['batch 32, float32, r = 4: every Linear >= 1.5x cuBLAS '
                    '(with g_x)']
    assert (linear.measured, linear.holds) == ('slowest layer 1.40x', False)
    weight = checks['batch 32, float32, r = 2: median weight-only backward '
                    'speedup over cuDNN >= 10x']
    assert weight.holds is None  # no weight-only row here
    slow = checks['batch 8, float32, r = 2: no layer slower than cuDNN '
                  '(with g_x)']
    assert (slow.measured, slow.holds) == ('slowest layer 0.90x', False)
    failed = [c for c in checks.values() if 'bfloat16' in c.target]
    assert failed and all(c.holds is None for c in failed)


def test_step_targets():
    rows = [dict(row='inference', lean=None, forward=1.0, step=1.0),
            dict(row='vanilla_last5:plain', lean=False, step=2.0),
            dict(row='gf_last5_r4:lean', lean=True, step=1.2,
                 peak_vs_inference=1.6, step_vs_inference=1.2)]
    checks = step_checks([dict(label='M', rows=rows)])
    verdicts = {c.target.split(': ', 1)[1]: c.holds for c in checks}
    assert verdicts == {'step peak <= 1.5x inference': False,
                        'step time <= 1.3x inference': True,
                        'step time <= vanilla, the same layers, lean=False':
                        True}


def _counted(label, model, lean, vanilla):
    def row(name, counts):
        return dict(row=name, **{p: dict(launches=n) for p, n in zip(
            ('forward', 'backward', 'optimizer', 'step'), counts)})
    return dict(label=label, model=model,
                rows=[row('vanilla_last5:plain', vanilla),
                      row('gf_last5_r4:lean', lean)],
                comparisons=[dict(lean='gf_last5_r4:lean',
                                  vanilla='vanilla_last5:plain',
                                  ratios=dict(forward=lean[0] / vanilla[0],
                                              step=lean[3] / vanilla[3]))])


def test_launch_targets_and_the_cpu_count_beside_them():
    recorded = [_counted('M', 'm', (11, 8, 2, 21), (10, 10, 2, 22))]
    golden = {'m': {'gf_last5_r4:lean': {'forward': {'launches': 9}}}}
    checks = {c.target: c for c in launch_checks(recorded, golden)}
    forward = checks['M gf_last5_r4:lean, kernels recorded: forward <= '
                     '1.1x vanilla-same-layers']
    step = checks['M gf_last5_r4:lean, kernels recorded: step <= 1x '
                  'vanilla-same-layers']
    assert (forward.measured, forward.holds) == ('1.10x', True)
    assert (step.measured, step.holds) == ('0.95x', True)
    table = launch_table(recorded, golden)
    assert '| M | gf_last5_r4:lean | 11 / 9 | 8 / ? |' in table
