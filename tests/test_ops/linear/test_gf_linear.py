"""The gradient-filtered linear layer against its float64 reference
(tests/helpers/gf_linear_reference.py) and the exact limits of
docs/gradient_filter.md#linear-layers-on-token-grids.

The tests that take ``device`` also run on CUDA tensors (``pytest -m
cuda``); their CPU path with the compiled kernels off is the one
tests/test_ops/linear/test_gf_linear_native.py compares with the kernels."""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from tests.helpers.devices import DEVICES
from tests.helpers.gf_linear_cases import LAYOUT_CASES as CASES
from tests.helpers.gf_linear_cases import linear_inputs as _inputs
from tests.helpers.gf_linear_reference import (
    patch_average, reference_linear_gradients)


def _filtered_grads(x, w, b, g, grid, radius, token_dim, device='cpu'):
    """The filtered layer's gradients computed on ``device``, returned on
    the CPU."""
    x, w, b = (t.clone().to(device).requires_grad_() for t in (x, w, b))
    y = gradient_filtered_linear(x, w, b, grid, radius, token_dim)
    assert torch.equal(y, F.linear(x, w, b))  # the forward is exact
    grads = torch.autograd.grad(y, (x, w, b), g.to(device))
    for got, wrt in zip(grads, (x, w, b)):
        assert got.device == wrt.device and got.dtype == wrt.dtype
    return tuple(t.cpu() for t in grads)


@pytest.mark.parametrize('grid,shape,token_dim', CASES)
@pytest.mark.parametrize('radius', [1, 2, 3, 4, 8])
def test_matches_float64_reference(grid, shape, token_dim, radius):
    x, w, b, g = _inputs(shape)
    got = _filtered_grads(x, w, b, g, grid, radius, token_dim)
    ref = reference_linear_gradients(x, w, g, grid.height, grid.width,
                                     grid.extra_tokens, grid.layout,
                                     token_dim, radius, grid.trailing_tokens)
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('grid,shape,token_dim', CASES)
def test_radius_1_is_the_exact_backward(grid, shape, token_dim):
    x, w, b, g = _inputs(shape, seed=1)
    got = _filtered_grads(x, w, b, g, grid, 1, token_dim)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    exact = torch.autograd.grad(F.linear(x, w, b), (x, w, b), g)
    for a, e in zip(got, exact):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('grid,shape,token_dim', CASES)
@pytest.mark.parametrize('radius', [2, 3])
def test_filtered_backward_is_the_exact_backward_of_patch_averaged_g(
        grid, shape, token_dim, radius, device):
    """Gradcheck-style identity: ``g_x`` and ``g_W`` are the exact vector-
    Jacobian products of ``F.linear`` at ``M g_y`` (``M``: patch means,
    extra tokens unchanged), ``g_b`` the exact one at ``g_y``; float64 on
    ``device``, the identity's side on the CPU."""
    x, w, b, g = _inputs(shape, seed=2)
    got = _filtered_grads(x, w, b, g, grid, radius, token_dim, device)
    mg = patch_average(g, grid.height, grid.width, grid.extra_tokens,
                       grid.layout, token_dim, radius)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    ex_x, ex_w = torch.autograd.grad(F.linear(x, w, b), (x, w), mg)
    torch.testing.assert_close(got[0], ex_x, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], ex_w, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[2], g.sum(dim=tuple(range(g.dim() - 1))),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('device', DEVICES)
def test_patch_constant_gradient_is_exact(device):
    """Exact limit: a ``g_y`` constant on every patch (and any extra-token
    gradient) gives the exact ``g_x``, ``g_W`` and ``g_b``."""
    grid, r = TokenGrid(6, 4, extra_tokens=1), 2
    x, w, b, g = _inputs((3, 25, 5), seed=3)
    g = patch_average(g, 6, 4, 1, 'tokens', 1, r)
    got = _filtered_grads(x, w, b, g, grid, r, 1, device)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    exact = torch.autograd.grad(F.linear(x, w, b), (x, w, b), g)
    for a, e in zip(got, exact):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_forward_keeps_patch_sums_and_extra_tokens_only():
    grid = TokenGrid(8, 6, extra_tokens=1)  # 4 x 3 patches at r = 2
    w = torch.randn(4, 5, requires_grad=True)
    x = torch.randn(2, 49, 5, requires_grad=True)
    saved = _saved_numels(
        lambda: gradient_filtered_linear(x, w, None, grid, 2))
    assert sorted(saved) == sorted([2 * 12 * 5, 2 * 1 * 5, w.numel()])
    # frozen weight: nothing derived from x at all
    w.requires_grad_(False)
    saved = _saved_numels(
        lambda: gradient_filtered_linear(x, w, None, grid, 2))
    assert saved == [w.numel()]


@pytest.mark.parametrize('device', DEVICES)
def test_noncontiguous_input_and_gradient(device):
    """(B, N, C) transposed to (N, B, C), as nn.MultiheadAttention does."""
    grid = TokenGrid(5, 4, extra_tokens=1)
    x, w, b, g = _inputs((3, 21, 6))
    xt, gt = x.transpose(0, 1), g.transpose(0, 1)
    assert not xt.is_contiguous()
    got = _filtered_grads(xt, w, b, gt, grid, 2, 0, device)
    ref = reference_linear_gradients(x, w, g, 5, 4, 1, 'tokens', 1, 2)
    torch.testing.assert_close(got[0], ref[0].transpose(0, 1), rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('device', DEVICES)
def test_autocast_bfloat16(device, monkeypatch):
    """Under autocast the forward is autocast's ``F.linear`` (bf16) and
    the backward accumulates in float32: the gradients keep the float32
    parameters' and input's dtypes and match the reference taken on the
    bf16-rounded operands."""
    # on a CPU without bfloat16 (an emulated Cortex-A76) torch's oneDNN
    # matmul fails and torch switches oneDNN off for the process: undone
    monkeypatch.setattr(torch.backends.mkldnn, 'enabled',
                        torch.backends.mkldnn.enabled)
    grid, r = TokenGrid(8, 8, extra_tokens=1), 4
    x, w, b, _ = _inputs((2, 65, 16), cout=8, dtype=torch.float32)
    x, w, b = (t.to(device).requires_grad_() for t in (x, w, b))
    with torch.autocast(device, dtype=torch.bfloat16):
        y = gradient_filtered_linear(x, w, b, grid, r)
        expected = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    g = torch.randn(y.shape).to(torch.bfloat16)
    y.backward(g.to(device))
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    assert x.grad.device == w.grad.device == b.grad.device == y.device
    ref = reference_linear_gradients(
        x.detach().cpu().to(torch.bfloat16),
        w.detach().cpu().to(torch.bfloat16), g, 8, 8, 1, 'tokens', 1, r)
    for got, want in zip((x.grad, w.grad, b.grad), ref):
        scale = float(want.abs().max())
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2,
                                   atol=2e-2 * scale)


@pytest.mark.parametrize('kwargs,shape,token_dim,match', [
    (dict(height=4, width=4), (2, 17, 3), 1,
     r'17 tokens on axis 1.*0 \+ 4\*4 \+ 0 = 16'),
    (dict(height=4, width=4, extra_tokens=1), (2, 16, 3), 1,
     r'16 tokens.*1 \+ 4\*4 \+ 0 = 17'),
    (dict(height=3, width=5, layout='hwc'), (2, 5, 3, 3), 1,
     r'H, W = \(5, 3\).*3 x 5'),
    (dict(height=2, width=2), (2, 4, 3), 2, r'token_dim=2 does not fit'),
    (dict(height=2, width=2, layout='hwc'), (2, 2, 3), 1,
     r'token_dim=1 does not fit'),
])
def test_grid_mismatch_is_refused(kwargs, shape, token_dim, match):
    grid = TokenGrid(**kwargs)
    with pytest.raises(ValueError, match=match):
        gradient_filtered_linear(torch.randn(shape), torch.randn(2, 3),
                                 None, grid, 2, token_dim)


@pytest.mark.parametrize('kwargs,match', [
    (dict(height=0, width=3), r'height must be an int >= 1'),
    (dict(height=2, width=2.0), r'width must be an int >= 1'),
    (dict(height=2, width=2, extra_tokens=-1), r'extra_tokens must be'),
    (dict(height=2, width=2, layout='nchw'), r"layout must be one of"),
    (dict(height=2, width=2, extra_tokens=1, layout='windows'),
     r'needs layout="tokens"'),
    (dict(height=2, width=2, layout='hwc', trailing_tokens=2),
     r'trailing_tokens=2 needs layout="tokens"'),
])
def test_bad_grid_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenGrid(**kwargs)


def test_bad_radius_is_refused():
    with pytest.raises(ValueError, match='radius must be an int >= 1'):
        gradient_filtered_linear(torch.randn(1, 4, 3), torch.randn(2, 3),
                                 None, TokenGrid(2, 2), 0)
