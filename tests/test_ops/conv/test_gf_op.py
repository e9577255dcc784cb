"""The gradient-filter operator against docs/gradient_filter.md (pure torch,
no mmseg)."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops import check_radius, gradient_filtered_conv2d
from tests.helpers.devices import DEVICES
from tests.helpers.gf_reference import exact_gradients, reference_gradients


def _run_op(x, weight, bias, grad_out, stride, padding, dilation, groups,
            radius, device='cpu'):
    """Output and gradients of the filtered conv on ``device``, returned
    on the CPU. (The kernels-off CPU path is checked against the compiled
    one in ``test_gf_native.py``.)"""
    x = x.detach().to(device).requires_grad_()
    weight = weight.detach().to(device).requires_grad_()
    bias = None if bias is None else bias.detach().to(device).requires_grad_()
    out = gradient_filtered_conv2d(x, weight, bias, stride, padding,
                                   dilation, groups, radius)
    assert out.device.type == device
    out.backward(grad_out.to(device, memory_format=torch.preserve_format))
    return (out.cpu(), x.grad.cpu(), weight.grad.cpu(),
            None if bias is None else bias.grad.cpu())


def _conv_case(seed, n, cin, cout, size, k, s, d, groups, padding=None):
    gen = torch.Generator().manual_seed(seed)
    p = (k - 1) * d // 2 if padding is None else padding
    x = torch.randn(n, cin, *size, generator=gen, dtype=torch.float64)
    weight = torch.randn(cout, cin // groups, k, k, generator=gen,
                         dtype=torch.float64)
    bias = torch.randn(cout, generator=gen, dtype=torch.float64)
    out = F.conv2d(x, weight, bias, s, p, d, groups)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return x, weight, bias, grad_out, (s, s), (p, p), (d, d)


GRID = [
    (s, k, dil, g, r)
    for s, k, g, r in itertools.product((1, 2), (1, 3, 5), ('1', 'C'),
                                        (1, 2, 3, 4, 7))
    for dil in sorted({1, 2, r, 2 * r})
]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('stride,kernel,dilation,groups,radius', GRID)
def test_gradients_match_independent_reference(stride, kernel, dilation,
                                               groups, radius, device):
    cin = cout = 4
    g = 1 if groups == '1' else cin
    x, w, b, gy, s, p, d = _conv_case(stride * 100 + kernel * 10 + radius, 2,
                                      cin, cout, (13, 11), kernel, stride,
                                      dilation, g)
    out, gx, gw, gb = _run_op(x, w, b, gy, s, p, d, g, radius, device)
    torch.testing.assert_close(out, F.conv2d(x, w, b, s, p, d, g),
                               rtol=0 if device == 'cpu' else 1e-12,
                               atol=0 if device == 'cpu' else 1e-12)
    ref_x, ref_w, ref_b = reference_gradients(x, w, gy, s, p, d, g, radius)
    torch.testing.assert_close(gx, ref_x, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gw, ref_w, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gb, ref_b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('size,padding', [((1, 1), 1), ((2, 3), 3),
                                          ((3, 5), 0), ((9, 7), 0),
                                          ((9, 7), 3)])
@pytest.mark.parametrize('device', DEVICES)
def test_unusual_padding_and_tiny_maps_match_reference(padding, size, device):
    x, w, b, gy, s, p, d = _conv_case(7, 2, 3, 5, size, 3, 1, 1, 1,
                                      padding=padding)
    out, gx, gw, gb = _run_op(x, w, b, gy, s, p, d, 1, 4, device)
    ref_x, ref_w, ref_b = reference_gradients(x, w, gy, s, p, d, 1, 4)
    torch.testing.assert_close(gx, ref_x, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gw, ref_w, rtol=1e-10, atol=1e-10)


def test_map_smaller_than_radius_is_one_patch():
    x, w, b, gy, s, p, d = _conv_case(3, 2, 3, 4, (3, 3), 3, 1, 1, 1)
    _, gx, gw, _ = _run_op(x, w, b, gy, s, p, d, 1, 8)
    mixed = torch.einsum('nc,cd->nd', gy.mean(dim=(2, 3)), w.sum(dim=(2, 3)))
    torch.testing.assert_close(gx, mixed[:, :, None, None].expand_as(x))
    expected_w = gy.mean(dim=(2, 3)).t() @ x.sum(dim=(2, 3))
    torch.testing.assert_close(gw, expected_w[:, :, None, None].expand_as(w))


def test_radius_one_with_1x1_kernel_is_exact():
    x, w, b, gy, s, p, d = _conv_case(5, 2, 6, 3, (10, 7), 1, 1, 1, 1)
    _, gx, gw, gb = _run_op(x, w, b, gy, s, p, d, 1, 1)
    ex, ew = exact_gradients(x, w, gy, s, p, d, 1)
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
    torch.testing.assert_close(gb, gy.sum(dim=(0, 2, 3)))


def _patch_constant(gy, r, zero_ring=0):
    """Replace every r x r patch of gy by one random value per patch."""
    n, c, h, w = gy.shape
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(n, c, h // r, w // r, generator=gen,
                         dtype=gy.dtype)
    if zero_ring:
        values[:, :, :zero_ring] = 0
        values[:, :, -zero_ring:] = 0
        values[:, :, :, :zero_ring] = 0
        values[:, :, :, -zero_ring:] = 0
    return values.repeat_interleave(r, 2).repeat_interleave(r, 3)


# Pairs where some pixels lie at least the kernel's half-width inside a patch.
@pytest.mark.parametrize('kernel,radius', [(1, 2), (1, 4), (3, 4), (3, 8),
                                           (5, 8)])
def test_limit_patch_constant_grad_gives_exact_interior_input_grad(
        kernel, radius):
    """Exact limit 1 (docs/gradient_filter.md#exact-limits): stride 1, g_y
    constant on patches."""
    half = (kernel - 1) // 2
    x, w, b, gy, s, p, d = _conv_case(1, 2, 3, 4, (4 * radius, 3 * radius),
                                      kernel, 1, 1, 1)
    gy = _patch_constant(gy, radius)
    _, gx, _, _ = _run_op(x, w, b, gy, s, p, d, 1, radius)
    ex, _ = exact_gradients(x, w, gy, s, p, d, 1)
    rows = torch.arange(x.shape[2]) % radius
    cols = torch.arange(x.shape[3]) % radius
    inner_rows = (rows >= half) & (rows < radius - half)
    inner_cols = (cols >= half) & (cols < radius - half)
    mask = inner_rows[:, None] & inner_cols[None, :]
    assert mask.any()
    torch.testing.assert_close(gx[..., mask], ex[..., mask])
    # ... and it really is an approximation elsewhere for k > 1.
    if kernel > 1 and radius > 2:
        assert not torch.allclose(gx, ex)


@pytest.mark.parametrize('stride', [1, 2])
@pytest.mark.parametrize('kernel', [1, 3, 5])
@pytest.mark.parametrize('radius', [2, 4])
def test_limit_patch_means_of_input_grad_and_weight_grad(
        stride, kernel, radius):
    """Exact limits 2 and 3 (docs/gradient_filter.md#exact-limits), any
    stride."""
    n, cin, cout, patches = 2, 3, 4, 6
    size = patches * radius * stride
    x, w, b, gy, s, p, d = _conv_case(2, n, cin, cout, (size, size), kernel,
                                      stride, 1, 1)
    gen = torch.Generator().manual_seed(3)
    per_channel = torch.randn(n, cout, 1, 1, generator=gen,
                              dtype=torch.float64)
    gy = per_channel.expand_as(gy).clone()
    ring = torch.ones(patches, patches, dtype=torch.bool)
    ring[1:-1, 1:-1] = False
    gy[..., ring.repeat_interleave(radius, 0).repeat_interleave(radius, 1)] = 0
    _, gx, _, _ = _run_op(x, w, b, gy, s, p, d, 1, radius)
    ex, _ = exact_gradients(x, w, gy, s, p, d, 1)
    side = radius * stride
    # Input patches whose taps do not reach the zero ring: 2 .. patches-3.
    exact_means = F.avg_pool2d(ex, side)[..., 2:-2, 2:-2]
    filtered = gx[..., ::side, ::side][..., 2:-2, 2:-2]
    torch.testing.assert_close(filtered, exact_means)

    # Limit 3: x constant per channel, g_y patch-constant with a zero ring.
    x_const = torch.randn(n, cin, 1, 1, generator=gen,
                          dtype=torch.float64).expand_as(x).clone()
    gy_patch = _patch_constant(gy, radius, zero_ring=1)
    _, _, gw, _ = _run_op(x_const, w, b, gy_patch, s, p, d, 1, radius)
    _, ew = exact_gradients(x_const, w, gy_patch, s, p, d, 1)
    torch.testing.assert_close(gw, ew)


@pytest.mark.parametrize('dilation_factor', [1, 2])
def test_dilated_limits(dilation_factor):
    """Exact limit 4, the dilated path (docs/gradient_filter.md#exact-limits):
    d a multiple of r, stride 1."""
    radius, kernel = 2, 3
    d = radius * dilation_factor
    patches = 8
    x, w, b, gy, s, p, dd = _conv_case(4, 2, 3, 4, (patches * radius,) * 2,
                                       kernel, 1, d, 1)
    gy = _patch_constant(gy, radius)
    _, gx, _, _ = _run_op(x, w, b, gy, s, p, dd, 1, radius)
    ex, _ = exact_gradients(x, w, gy, s, p, dd, 1)
    inner = slice(d, -d)  # taps of these pixels stay inside the map
    torch.testing.assert_close(gx[..., inner, inner], ex[..., inner, inner])

    ring = (kernel - 1) * d // (2 * radius)
    x_patch = _patch_constant(x, radius)
    gy_ring = _patch_constant(gy, radius, zero_ring=ring)
    _, _, gw, _ = _run_op(x_patch, w, b, gy_ring, s, p, dd, 1, radius)
    _, ew = exact_gradients(x_patch, w, gy_ring, s, p, dd, 1)
    torch.testing.assert_close(gw, ew)


def test_forward_saves_only_patch_sums():
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 4)
    assert (2, 8, 8, 8) in saved  # the patch sums x~
    assert tuple(x.shape) not in saved
    assert all(math.prod(s) < x.numel() / 4 for s in saved)
    out.sum().backward()


def test_frozen_weight_saves_nothing_of_x_and_skips_input_grad():
    x = torch.randn(2, 8, 16, 16)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 4)
    out.sum().backward()
    assert x.grad is None and w.grad is not None
    x.requires_grad_()
    w2 = w.detach()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = gradient_filtered_conv2d(x, w2, None, 1, 1, 1, 1, 4)
    assert saved == [tuple(w.shape)]  # weight only, no x~ needed
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize('device', DEVICES)
def test_same_padding_even_kernel_and_channels_last(device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 12, 12, generator=gen)
    w = torch.randn(4, 4, 4, 4, generator=gen)
    x_on, w_on = x.to(device), w.to(device)
    out = gradient_filtered_conv2d(x_on, w_on, None, 1, 'same', 1, 1, 2)
    assert torch.equal(out, F.conv2d(x_on, w_on, None, 1, 'same'))

    w3 = torch.randn(4, 4, 3, 3, generator=gen)
    gy = torch.randn(2, 4, 12, 12, generator=gen)
    _, gx, gw, _ = _run_op(x, w3, None, gy, 1, 1, 1, 1, 2, device)
    _, gx_cl, gw_cl, _ = _run_op(
        x.contiguous(memory_format=torch.channels_last), w3, None,
        gy.contiguous(memory_format=torch.channels_last), 1, 1, 1, 1, 2,
        device)
    torch.testing.assert_close(gx_cl, gx)
    torch.testing.assert_close(gw_cl, gw)


def test_bfloat16_autocast_matches_float32():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, 16, generator=gen)
    w = torch.randn(8, 8, 3, 3, generator=gen) * 0.1
    gy = torch.randn(2, 8, 16, 16, generator=gen)
    _, gx, gw, _ = _run_op(x, w, None, gy, 1, 1, 1, 1, 4)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = gradient_filtered_conv2d(xb, wb, None, 1, 1, 1, 1, 4)
    assert out.dtype == torch.bfloat16
    out.backward(gy.to(torch.bfloat16))
    assert xb.grad.dtype == torch.float32 and wb.grad.dtype == torch.float32
    torch.testing.assert_close(xb.grad, gx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(wb.grad, gw, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize('device', DEVICES)
def test_nan_in_output_grad_propagates(device):
    x = torch.randn(1, 2, 8, 8, device=device, requires_grad=True)
    w = torch.randn(2, 2, 3, 3, device=device, requires_grad=True)
    out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 4)
    gy = torch.zeros_like(out)
    gy[0, 0, 1, 1] = float('nan')
    out.backward(gy)
    assert torch.isnan(x.grad[0, :, :4, :4]).all()
    assert torch.isnan(w.grad[0]).all()


@pytest.mark.parametrize('bad', [0, -1, 2.0, '4', True, None])
def test_bad_radius_is_refused(bad):
    with pytest.raises(ValueError, match='radius must be an int >= 1'):
        check_radius(bad)


def test_meta_tensors_give_gradient_shapes():
    """Shape inference (e.g. model summaries) runs on the meta device."""
    x = torch.empty(2, 3, 9, 9, device='meta', requires_grad=True)
    w = torch.empty(4, 3, 3, 3, device='meta', requires_grad=True)
    out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 4)
    gx, gw = torch.autograd.grad(out, (x, w), torch.empty_like(out))
    assert gx.shape == x.shape and gw.shape == w.shape
    assert gx.device.type == 'meta'


@pytest.mark.parametrize('channels,grid,groups', [
    (8, (9, 7), 1),    # large grid: one GEMM per image
    (8, (9, 7), 2),
    (48, (2, 2), 1),   # small grid, many channels: batch x cells gathered
    (48, (2, 2), 4),
])
def test_pooled_weight_grad_both_strategies(channels, grid, groups):
    """Both ways of summing the patch-grid weight gradient over the batch
    equal the plain sum of per-image, per-group products."""
    from mmseg_gf.ops.conv.function import _pooled_weight_grad
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, channels, *grid, generator=gen, dtype=torch.float64)
    x = torch.randn(3, channels, *grid, generator=gen, dtype=torch.float64)
    cg = channels // groups
    want = torch.stack([
        sum(g[n, k * cg:(k + 1) * cg].reshape(cg, -1)
            @ x[n, k * cg:(k + 1) * cg].reshape(cg, -1).T for n in range(3))
        for k in range(groups)
    ])
    torch.testing.assert_close(_pooled_weight_grad(g, x, groups), want)
