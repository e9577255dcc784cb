"""Cases of the filtered Linear's Triton path (``mmseg_gf.ops.linear.gpu``);
run by ``tests/test_ops/linear/test_gf_linear_triton.py`` in a subprocess.

Not collected on its own, for the reason given in
``tests/helpers/triton_cases.py`` (``TRITON_INTERPRET`` is read when
triton is imported). Run directly::

    TRITON_INTERPRET=1 python -m pytest -q \
        tests/helpers/triton_linear_cases.py
    python -m pytest -q tests/helpers/triton_linear_cases.py  # CUDA

Under the interpreter the tensors are CPU tensors and the shapes tiny; on a
GPU the same cases run compiled.
"""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from mmseg_gf.ops.linear import gpu as triton_linear
from tests.helpers.triton_runs import case_device, pytorch_path, triton_enabled
from tests.helpers.gf_linear_cases import LAYOUT_CASES, linear_inputs
from tests.helpers.gf_linear_reference import reference_linear_gradients

DEVICE = case_device()

# Every layout of the op's tests, plus a grid whose leading axes do not
# merge into one (g_x staged, g_y copied): 'hwc' with the batch before and
# a head axis after the grid.
CASES = LAYOUT_CASES + [(TokenGrid(3, 2, layout='hwc'), (2, 3, 2, 2, 5), 1)]
IDS = [f'{g.layout}{g.height}x{g.width}+{g.extra_tokens}+'
       f'{g.trailing_tokens}-{"x".join(map(str, s))}-d{d}'
       for g, s, d in CASES]


def _grads(x, w, b, g, grid, radius, token_dim, need=(True, True, True),
           device=None):
    """Forward and backward on ``device`` (DEVICE); the gradients asked
    for (None for the others) on the CPU, and whether the Triton backward
    ran."""
    device = device or DEVICE
    leaves = [None if t is None else t.to(device).requires_grad_(flag)
              for t, flag in zip((x, w, b), need)]
    calls = triton_linear.backward_calls()
    y = gradient_filtered_linear(leaves[0], leaves[1], leaves[2], grid,
                                 radius, token_dim)
    assert torch.equal(y, F.linear(*leaves))  # the forward is exact
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(y, wanted, g.to(device)))
    ran = triton_linear.backward_calls() - calls
    return [next(got).cpu() if t is not None and t.requires_grad else None
            for t in leaves], ran


# Every case on the fused products (ops/conv/products_kernels.py), the default;
# the GEMM route (MMSEG_GF_FUSED_PRODUCTS=0) at r = 3.
@pytest.mark.parametrize('radius,fused', [(2, True), (3, True), (3, False)])
@pytest.mark.parametrize('grid,shape,token_dim', CASES, ids=IDS)
def test_float64_matches_independent_reference(grid, shape, token_dim,
                                               radius, fused):
    """Every layout (extra and trailing tokens, (N, B, C), 'hwc', windows,
    unbatched, partial border patches at r = 2 and 3): the Triton path's
    gradients are those of tests/helpers/gf_linear_reference.py (explicit
    loops) to float64 rounding, on both routes of its products."""
    from mmseg_gf.ops.backend import switches
    x, w, b, g = linear_inputs(shape, dtype=torch.float64)
    with switches.override(MMSEG_GF_FUSED_PRODUCTS=fused):
        (gx, gw, gb), ran = _grads(x, w, b, g, grid, radius, token_dim)
    assert ran == 1
    ref = reference_linear_gradients(x, w, g, grid.height, grid.width,
                                     grid.extra_tokens, grid.layout,
                                     token_dim, radius, grid.trailing_tokens)
    for got, want in zip((gx, gw, gb), ref):
        assert got.dtype == torch.float64 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# (need x, need W, bias present and needed): weight only, with and without
# bias; g_x only; everything without a bias.
NEEDS = [(False, True, False), (False, True, True), (True, False, False),
         (True, True, False)]


@pytest.mark.parametrize('need', NEEDS, ids=str)
@pytest.mark.parametrize('case', [1, 4, 5], ids=lambda i: IDS[i])
def test_float32_needed_gradients_match_the_torch_path(case, need):
    """Weight only, input only, with and without bias (cls tokens, 'hwc',
    windows, r = 3): float32 gradients equal the pure-PyTorch path's to
    float32 rounding; gradients not asked for are None."""
    grid, shape, token_dim = CASES[case]
    x, w, b, g = linear_inputs(shape, seed=1, dtype=torch.float32)
    if not need[2]:
        b = None
    got, ran = _grads(x, w, b, g, grid, 3, token_dim, need)
    assert ran == 1
    with pytorch_path():
        want, ran = _grads(x, w, b, g, grid, 3, token_dim, need, 'cpu')
    assert ran == 0
    for flag, a, e in zip(need, got, want):
        if not flag:
            assert a is None and e is None
            continue
        torch.testing.assert_close(a, e, rtol=1e-5,
                                   atol=1e-6 * float(e.abs().max()))


def test_non_contiguous_output_gradient():
    """``g_y`` of any strides is read in place: a transposed copy and the
    expanded constant of ``y.sum()``."""
    grid, shape, token_dim = CASES[1]
    x, w, b, g = linear_inputs(shape, seed=2, dtype=torch.float32)
    for grad in (g.transpose(0, 1).contiguous().transpose(0, 1),
                 torch.ones(()).expand_as(g)):
        assert not grad.is_contiguous()
        got, ran = _grads(x, w, b, grad, grid, 2, token_dim)
        assert ran == 1
        with pytorch_path():
            want, _ = _grads(x, w, b, grad, grid, 2, token_dim, device='cpu')
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-5,
                                       atol=1e-6 * float(e.abs().max()))


def test_autocast_bfloat16_gradient():
    """Under autocast ``g_y`` is bfloat16: its patch means and the products
    run in float32; the gradients come back in the leaves' float32 and
    equal the float32 path's on the rounded ``g_y``."""
    grid, shape, token_dim = CASES[1]
    x, w, b, g = linear_inputs(shape, seed=3, dtype=torch.float32)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, w, b)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = gradient_filtered_linear(*leaves, grid, 2, token_dim)
    assert y.dtype == torch.bfloat16
    grad = g.to(torch.bfloat16)
    got = torch.autograd.grad(y, leaves, grad.to(DEVICE))
    with pytorch_path():
        want, _ = _grads(x, w, b, grad.float(), grid, 2, token_dim,
                         device='cpu')
    for a, e in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5,
                                   atol=1e-5 * float(e.abs().max()))


def test_switch_turns_the_path_off(switch_override):
    """``set_enabled(False)`` and ``MMSEG_GF_TRITON=0`` (the conv's switch,
    ``tools/benchmark_layers.py --no-triton``) send the Linear to the
    PyTorch path: the Triton backward does not run, the gradients are the
    same."""
    grid, shape, token_dim = CASES[0]
    x, w, b, g = linear_inputs(shape, seed=4, dtype=torch.float64)
    on, ran = _grads(x, w, b, g, grid, 2, token_dim)
    assert ran == 1
    with triton_enabled(False):
        off, ran = _grads(x, w, b, g, grid, 2, token_dim)
    assert ran == 0
    switch_override(MMSEG_GF_TRITON=False)
    with triton_enabled(None):
        env_off, ran = _grads(x, w, b, g, grid, 2, token_dim)
    assert ran == 0
    for a, e, f in zip(on, off, env_off):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(f, e, rtol=0, atol=0)
