"""The Triton GPU path (``mmseg_gf.ops.triton_path``).

Its kernels are checked by ``tests/triton_cases.py`` in a subprocess:
under triton's interpreter on CPU tensors (every machine with triton, no
GPU needed) and compiled on CUDA where there is a GPU. ``TRITON_INTERPRET``
only takes effect before triton is imported, and in this process it must
stay off (every CPU conv would take the interpreter), hence the
subprocess. The tests here also cover the switch and a machine without
triton.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmseg_gf.ops import gradient_filtered_conv2d, triton_path

ROOT = Path(__file__).resolve().parents[1]
TRITON = pytest.mark.skipif(
    not triton_path.installed(),
    reason='triton is not installed (requirements/tests.txt pins it)')
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason='no CUDA GPU on this machine')


def _run_cases(interpret: bool, *args: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET='1' if interpret else '0')
    env.pop('MMSEG_GF_TRITON', None)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (str(ROOT), env.get('PYTHONPATH')) if p)
    proc = subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider',
         '-rs', str(ROOT / 'tests' / 'triton_cases.py'), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert ' passed' in report and ' failed' not in report, report
    return report


@TRITON
def test_kernels_under_the_triton_interpreter():
    """Every case of ``triton_cases.py`` on CPU tensors, interpreted."""
    report = _run_cases(True)
    assert 'skipped' not in report, report


@TRITON
@CUDA
def test_kernels_compiled_on_cuda():
    """The same cases on CUDA tensors, compiled (float16 autocast too)."""
    report = _run_cases(False)
    assert 'skipped' not in report, report


@TRITON
@CUDA
def test_cuda_graphs_reduce_overhead_gives_eager_gradients():
    """``torch.compile(mode='reduce-overhead')``: inductor plus CUDA
    graphs, with the Triton ops captured; replays give eager gradients."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 30, 22, generator=gen).cuda().requires_grad_()
    w = torch.randn(32, 16, 3, 3, generator=gen).cuda().requires_grad_()
    b = torch.randn(32, generator=gen).cuda().requires_grad_()

    def loss(x, w, b):
        out = gradient_filtered_conv2d(x, w, b, 1, 1, 1, 1, 4)
        return (out * out).sum()

    def grads(fn):
        for t in (x, w, b):
            t.grad = None
        fn(x, w, b).backward()
        return [t.grad.clone() for t in (x, w, b)]

    eager = grads(loss)
    compiled = torch.compile(loss, mode='reduce-overhead', fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        got = grads(compiled)
    for g, r in zip(got, eager):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_switch_and_cpu_tensors_without_the_interpreter(monkeypatch):
    """``set_enabled`` overrides ``MMSEG_GF_TRITON``; CPU tensors never take
    the Triton path unless the interpreter was on at import."""
    x, w = torch.zeros(1, 2, 4, 4), torch.zeros(2, 2, 3, 3)
    assert not triton_path.usable(x, w, None)
    monkeypatch.setenv('MMSEG_GF_TRITON', '0')
    assert not triton_path.enabled()
    previous = triton_path.set_enabled(True)
    try:
        assert triton_path.enabled() == triton_path.installed()
        triton_path.set_enabled(None)
        assert not triton_path.enabled()
        monkeypatch.setenv('MMSEG_GF_TRITON', '1')
        assert triton_path.enabled() == triton_path.installed()
    finally:
        triton_path.set_enabled(previous)


def test_package_runs_without_triton():
    """With ``import triton`` failing, mmseg_gf imports, reports the path
    unavailable and computes filtered gradients (pure PyTorch / C++)."""
    code = '\n'.join([
        'import sys', 'sys.modules["triton"] = None',
        'import torch', 'from mmseg_gf.ops import gradient_filtered_conv2d, '
        'triton_path',
        'assert not triton_path.installed() and not triton_path.enabled()',
        'x = torch.randn(1, 2, 6, 6, requires_grad=True)',
        'w = torch.randn(3, 2, 3, 3, requires_grad=True)',
        'gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2).sum().backward()',
        'assert x.grad.shape == x.shape and w.grad.abs().sum() > 0',
        'assert triton_path.backward_calls() == 0',
        'print("ok")'])
    env = dict(os.environ, TRITON_INTERPRET='1')
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (str(ROOT), env.get('PYTHONPATH')) if p)
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == 'ok', proc.stderr
