"""GELU keeping the patch means of its derivative between two filtered
layers (docs/gradient_filter.md#elementwise-ops-between-filtered-layers).

* the op against a float64 loop reference of its formula (patch means of
  ``f'`` over the valid elements of each patch, exact ``f'`` on tokens on no
  grid);
* the point of it: in the chain ``U -> GELU -> D`` with ``U`` and ``D``
  filtered on the same partition, every gradient (``U``'s weight, bias and
  input, ``D``'s weight and bias) equals the chain with autograd's GELU,
  float64, rtol 1e-10: conv maps (``U`` a 1x1 or a depthwise 3x3 conv, ``D``
  a 1x1 or a 3x3 pad-1 conv), token grids with cls and trailing tokens,
  ``(N, B, C)`` and ``'hwc'`` layouts, partial border patches; hypothesis
  over sizes and radii;
* the op keeps ``1/r^2`` of the input's elements (plus the extra tokens),
  and its forward is ``F.gelu``'s bit for bit.

The op's tests and the token chain's take ``device_path``: the compiled
patch sums on the CPU, the PyTorch path CUDA tensors take on the CPU, and
CUDA tensors (``pytest -m cuda``).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmseg_gf.ops.conv.function import gradient_filtered_conv2d
from mmseg_gf.ops.linear.function import gradient_filtered_linear
from mmseg_gf.ops.linear.token_grid import TokenGrid
from mmseg_gf.ops.linear.patch_mean_activation import (PatchPartition,
                                                       gelu_derivative,
                                                       patch_mean_gelu,
                                                       patch_mean_kept_elements,
                                                       tag_output,
                                                       tagged_partition)
from tests.helpers.devices import DEVICE_PATHS, on_path

D64 = torch.float64


def _reference_map_grad(x, g, r, approximate):
    """``g * mean_P f'(x)`` with explicit loops over the patches."""
    slope = gelu_derivative(x, approximate)
    out = torch.empty_like(g)
    h, w = x.shape[-2:]
    for i in range(0, h, r):
        for j in range(0, w, r):
            mean = slope[:, :, i:i + r, j:j + r].mean(dim=(2, 3),
                                                      keepdim=True)
            out[:, :, i:i + r, j:j + r] = g[:, :, i:i + r, j:j + r] * mean
    return out


def _reference_token_grad(x, g, grid, r, approximate):
    """Tokens ``(B, N, C)``: grid tokens by patch, extra tokens exact."""
    slope = gelu_derivative(x, approximate)
    out = g * slope  # extra tokens keep this
    first = grid.extra_tokens
    for i in range(0, grid.height, r):
        for j in range(0, grid.width, r):
            tokens = [first + a * grid.width + b
                      for a in range(i, min(i + r, grid.height))
                      for b in range(j, min(j + r, grid.width))]
            mean = slope[:, tokens].mean(dim=1, keepdim=True)
            out[:, tokens] = g[:, tokens] * mean
    return out


def _leaf(t, device):
    return t.to(device).requires_grad_(True)


@pytest.mark.parametrize('device_path', DEVICE_PATHS)
@pytest.mark.parametrize('approximate', ['none', 'tanh'])
@pytest.mark.parametrize('size', [(8, 8), (7, 10)])
def test_map_op_matches_the_loop_reference(approximate, size, device_path):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, *size, dtype=D64, generator=gen)
    g = torch.randn(2, 3, *size, dtype=D64, generator=gen)
    part = PatchPartition.conv_map(4, *size)
    with on_path(device_path) as device:
        x = _leaf(x0, device)
        y = patch_mean_gelu(x, approximate, part)
        assert torch.equal(y, F.gelu(x, approximate=approximate))
        y.backward(g.to(device))
    assert x.grad.device == x.device
    torch.testing.assert_close(
        x.grad.cpu(), _reference_map_grad(x0, g, 4, approximate),
        rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize('device_path', DEVICE_PATHS)
@pytest.mark.parametrize('grid', [TokenGrid(5, 6, extra_tokens=1),
                                  TokenGrid(4, 4, trailing_tokens=2),
                                  TokenGrid(3, 7)])
def test_token_op_matches_the_loop_reference(grid, device_path):
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, grid.num_tokens, 5, dtype=D64, generator=gen)
    g = torch.randn(x0.shape, dtype=D64, generator=gen)
    with on_path(device_path) as device:
        x = _leaf(x0, device)
        y = patch_mean_gelu(x, 'none', PatchPartition.tokens(grid, 2, 1))
        assert torch.equal(y, F.gelu(x))
        y.backward(g.to(device))
    assert x.grad.device == x.device
    torch.testing.assert_close(
        x.grad.cpu(), _reference_token_grad(x0, g, grid, 2, 'none'),
        rtol=1e-12, atol=1e-14)


def _conv_chain(x, params, r, gelu, up_kernel, down_kernel):
    w_u, b_u, w_d, b_d = params
    groups = w_u.shape[0] if up_kernel == 3 else 1
    u = gradient_filtered_conv2d(x, w_u, b_u, padding=up_kernel // 2,
                                 groups=groups, radius=r)
    y = gelu(u)
    return gradient_filtered_conv2d(y, w_d, b_d, padding=down_kernel // 2,
                                    radius=r)


def _grads(chain, x, params, g):
    for t in (x, *params):
        t.grad = None
    chain(x, params).backward(g)
    return [t.grad.clone() for t in (x, *params)]


def _check_chain_conv(size, r, up_kernel, down_kernel, seed=0,
                      approximate='none'):
    gen = torch.Generator().manual_seed(seed)
    c = 4
    x = torch.randn(2, c, *size, dtype=D64, generator=gen,
                    requires_grad=True)
    w_u = torch.randn(c, 1 if up_kernel == 3 else c, up_kernel, up_kernel,
                      dtype=D64, generator=gen)
    w_d = torch.randn(3, c, down_kernel, down_kernel, dtype=D64,
                      generator=gen)
    params = [w_u, torch.randn(c, dtype=D64, generator=gen), w_d,
              torch.randn(3, dtype=D64, generator=gen)]
    for p in params:
        p.requires_grad_(True)
    g = torch.randn(2, 3, *size, dtype=D64, generator=gen)
    part = PatchPartition.conv_map(r, *size)

    def patch_rule(u):
        return patch_mean_gelu(u, approximate, part)

    def exact(u):
        return F.gelu(u, approximate=approximate)

    got = _grads(lambda a, p: _conv_chain(a, p, r, patch_rule, up_kernel,
                                          down_kernel), x, params, g)
    want = _grads(lambda a, p: _conv_chain(a, p, r, exact, up_kernel,
                                           down_kernel), x, params, g)
    for name, a, b in zip(('x', 'w_u', 'b_u', 'w_d', 'b_d'), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f'{name}: {m}')
    return got, want


@pytest.mark.parametrize('up_kernel,down_kernel', [(1, 1), (3, 1), (3, 3)])
@pytest.mark.parametrize('size', [(8, 8), (7, 10)])
def test_conv_chain_gradients_equal_the_exact_gelus(up_kernel, down_kernel,
                                                    size):
    _check_chain_conv(size, 4, up_kernel, down_kernel)


def test_the_rule_differs_from_autograd_elementwise():
    """Not a no-op: the input gradient of the GELU alone differs from
    autograd's (only its patch means agree)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 8, 8, dtype=D64, generator=gen, requires_grad=True)
    g = torch.randn(1, 2, 8, 8, dtype=D64, generator=gen)
    patch_mean_gelu(x, 'none', PatchPartition.conv_map(4, 8, 8)).backward(g)
    want = torch.autograd.grad(F.gelu(x), x, g)[0]
    assert not torch.allclose(x.grad, want, rtol=1e-3)


@settings(max_examples=15, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), r=st.integers(1, 5),
       up=st.sampled_from([1, 3]), down=st.sampled_from([1, 3]),
       tanh=st.booleans(), seed=st.integers(0, 100))
def test_conv_chain_property(h, w, r, up, down, tanh, seed):
    _check_chain_conv((h, w), r, up, down, seed,
                      'tanh' if tanh else 'none')


def _check_chain_tokens(grid, r, token_dim, seed=0, device='cpu'):
    gen = torch.Generator().manual_seed(seed)
    c = 5
    batch = 2
    if grid.layout == 'hwc':
        shape = (batch, grid.height, grid.width, c)
    elif token_dim == 0:
        shape = (grid.num_tokens, batch, c)
    else:
        shape = (batch, grid.num_tokens, c)
    x = _leaf(torch.randn(shape, dtype=D64, generator=gen), device)
    params = [_leaf(p, device) for p in (
        torch.randn(6, c, dtype=D64, generator=gen),
        torch.randn(6, dtype=D64, generator=gen),
        torch.randn(3, 6, dtype=D64, generator=gen),
        torch.randn(3, dtype=D64, generator=gen))]
    g = torch.randn(*shape[:-1], 3, dtype=D64, generator=gen).to(device)
    part = PatchPartition.tokens(grid, r, token_dim)

    def chain(gelu):
        def run(a, p):
            u = gradient_filtered_linear(a, p[0], p[1], grid, r, token_dim)
            return gradient_filtered_linear(gelu(u), p[2], p[3], grid, r,
                                            token_dim)
        return run

    got = _grads(chain(lambda u: patch_mean_gelu(u, 'none', part)), x,
                 params, g)
    want = _grads(chain(F.gelu), x, params, g)
    for name, a, b in zip(('x', 'w_u', 'b_u', 'w_d', 'b_d'), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f'{name}: {m}')


@pytest.mark.parametrize('device_path', DEVICE_PATHS)
@pytest.mark.parametrize('grid,token_dim', [
    (TokenGrid(8, 8), 1),
    (TokenGrid(5, 7, extra_tokens=1), 1),  # cls token, partial patches
    (TokenGrid(6, 5, extra_tokens=2, trailing_tokens=3), 1),
    (TokenGrid(5, 6, extra_tokens=1), 0),  # (N, B, C)
    (TokenGrid(6, 7, layout='hwc'), 1),
])
def test_token_chain_gradients_equal_the_exact_gelus(grid, token_dim,
                                                     device_path):
    with on_path(device_path) as device:
        _check_chain_tokens(grid, 4, token_dim, device=device)


@settings(max_examples=15, deadline=None)
@given(h=st.integers(1, 8), w=st.integers(1, 8), r=st.integers(1, 4),
       extra=st.integers(0, 2), trailing=st.integers(0, 2),
       seed=st.integers(0, 100))
def test_token_chain_property(h, w, r, extra, trailing, seed):
    _check_chain_tokens(TokenGrid(h, w, extra, trailing_tokens=trailing), r,
                        1, seed)


def test_kept_elements_and_what_is_saved():
    x = torch.randn(2, 3, 9, 8, requires_grad=True)
    part = PatchPartition.conv_map(4, 9, 8)
    y = patch_mean_gelu(x, 'none', part)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert sum(t.numel() for t in saved) == patch_mean_kept_elements(
        x.shape, part) == 2 * 3 * 3 * 2
    assert all(t.dtype == x.dtype for t in saved)
    grid = TokenGrid(5, 4, extra_tokens=1)
    part = PatchPartition.tokens(grid, 2, 1)
    for batch in (1, 2):
        x = torch.randn(batch, 21, 6, requires_grad=True)
        y = patch_mean_gelu(x, 'none', part)
        saved = [t for t in y.grad_fn.saved_tensors if t is not None]
        # storages of their own (no view of a full-size temporary)
        assert sum(t.untyped_storage().nbytes() for t in saved) == 4 * sum(
            t.numel() for t in saved)
        assert sum(t.numel() for t in saved) == patch_mean_kept_elements(
            x.shape, part) == batch * 6 * (3 * 2 + 1)


def test_tags_and_shape_checks():
    x = torch.randn(1, 2, 4, 4)
    part = PatchPartition.conv_map(2, 4, 4)
    assert tagged_partition(x) is None
    tag_output(x, part)
    assert tagged_partition(x) == part
    x.add_(1)  # an in-place change voids the tag
    assert tagged_partition(x) is None
    with pytest.raises(ValueError, match='does not hold'):
        patch_mean_gelu(torch.randn(1, 2, 4, 5), 'none', part)
    grid_part = PatchPartition.tokens(TokenGrid(2, 2, extra_tokens=1), 2, 1)
    assert grid_part.fits(torch.randn(1, 5, 3))
    assert not grid_part.fits(torch.randn(1, 4, 3))


@pytest.mark.parametrize('size', [(16, 16), (6, 5)])
@pytest.mark.parametrize('tokens', [False, True])
def test_forward_launches_on_the_cuda_path(size, tokens):
    """On the path CUDA tensors take, the forward launches ``F.gelu``,
    ``f'`` and one pooling that divides as it sums (partial border
    patches included): no fill of a one, no separate scaling or counts
    (after a first call, which makes the broadcast one)."""
    from mmseg_gf.accounting.cuda_path import cuda_path
    from mmseg_gf.accounting.launches import LaunchCounter
    h, w = size
    if tokens:
        x = torch.randn(2, h * w, 8)
        part = PatchPartition.tokens(TokenGrid(h, w), 4, 1)
    else:
        x = torch.randn(2, 8, h, w)
        part = PatchPartition.conv_map(4, h, w)
    x.requires_grad_(True)
    with cuda_path(triton=False):
        patch_mean_gelu(x * 1, 'none', part)
        inner = x * 1  # a non-leaf input, as between two layers
        counter = LaunchCounter()
        with counter:
            patch_mean_gelu(inner, 'none', part)
    ops = [launch.op.split('.')[1] for launch in counter.result.launches]
    assert ops == ['gelu', 'gelu_backward', 'avg_pool2d'], ops
