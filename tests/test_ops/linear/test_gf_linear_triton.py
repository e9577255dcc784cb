"""The filtered Linear's Triton path (``mmseg_gf.ops.linear.gpu``).

Its cases (``tests/helpers/triton_linear_cases.py``) run in a subprocess: under
triton's interpreter on CPU tensors (every machine with triton) and
compiled on CUDA where there is a GPU (``TRITON_INTERPRET`` must stay off
in this process; see tests/test_ops/conv/test_gf_triton.py). The tests here
also cover the switch and, on CUDA, the path in this process.
"""
import pytest
import torch

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from mmseg_gf.ops.linear import gpu as triton_linear
from mmseg_gf.ops.backend import availability, triton_runtime
from tests.helpers.devices import DEVICES
from tests.helpers.triton_runs import CASE_RUNS, TRITON, run_case_file
from tests.helpers.gf_linear_reference import reference_linear_gradients


@TRITON
@pytest.mark.parametrize('interpret', CASE_RUNS)
def test_cases(interpret):
    """Every case of ``triton_linear_cases.py``: on CPU tensors,
    interpreted; on CUDA tensors, compiled."""
    run_case_file('triton_linear_cases.py', interpret)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('radius', [2, 3])
def test_cuda_tensors_take_the_triton_path(device, radius):
    """In this process (interpreter off): CUDA tensors take the Triton
    backward where triton is installed, CPU tensors never; both give the
    float64 reference's gradients (cls token, partial patches)."""
    grid, shape = TokenGrid(5, 7, extra_tokens=2), (2, 37, 6)
    gen = torch.Generator().manual_seed(0)
    x, g = (torch.randn(*shape[:-1], c, generator=gen, dtype=torch.float64)
            for c in (6, 4))
    w = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64)
    leaves = [t.to(device).requires_grad_() for t in (x, w, b)]
    calls = triton_linear.backward_calls()
    y = gradient_filtered_linear(*leaves, grid, radius, 1)
    got = torch.autograd.grad(y, leaves, g.to(device))
    expected = int(device == 'cuda' and availability.triton_enabled())
    assert triton_linear.backward_calls() - calls == expected
    ref = reference_linear_gradients(x, w, g, 5, 7, 2, 'tokens', 1, radius)
    for a, e in zip(got, ref):
        assert a.device.type == device
        torch.testing.assert_close(a.cpu(), e, rtol=1e-10, atol=1e-10)


def test_switch_decides_usable(monkeypatch, switch_override):
    """The Linear follows the conv's switch: ``set_enabled`` over
    ``MMSEG_GF_TRITON``; CPU tensors only under the interpreter (faked
    here: the predicate alone, no kernel runs)."""
    x = torch.zeros(2, 3, 3, 4)
    assert not triton_linear.usable(x)  # interpreter off in this process
    monkeypatch.setattr(triton_runtime, 'INTERPRETED', True)
    switch_override(MMSEG_GF_TRITON=True)
    previous = availability.set_triton_enabled(None)
    try:
        assert triton_linear.usable(x) == availability.triton_installed()
        assert not triton_linear.usable(x.int())
        assert not triton_linear.usable(x[:0])
        availability.set_triton_enabled(False)
        assert not triton_linear.usable(x)
        availability.set_triton_enabled(None)
        switch_override(MMSEG_GF_TRITON=False)
        assert not triton_linear.usable(x)
        assert not triton_linear.usable(x.to('meta'))
    finally:
        availability.set_triton_enabled(previous)
