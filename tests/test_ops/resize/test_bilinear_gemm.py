"""mmseg_gf.ops.resize.gemm: a bilinear resize and its input gradient as
two matrix products give ``F.interpolate``'s output and autograd's gradient
(float64 to rounding, float32 within its rounding), on every resize a head
or a loss makes (up, down, ``align_corners``, scale factors), a channel
slice's gradient included; CUDA tensors take it through ``ops.resize`` and
the resized loss, and the switch turns it off."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops.resize import gemm as bilinear_gemm
from mmseg_gf.ops.backend import switches
from mmseg_gf.ops.backend.device_path import as_on_cuda
from mmseg_gf.ops.resize.bilinear import BilinearResizeFunction
from tests.helpers.devices import needs_cuda

RESIZES = [
    ((8, 8), dict(size=(64, 64), align_corners=False)),  # a loss's 8x
    ((7, 9), dict(size=(13, 11), align_corners=True)),
    ((13, 11), dict(size=(3, 4), align_corners=False)),  # downsampling
    ((5, 6), dict(scale_factor=2.0, align_corners=False)),
    ((5, 6), dict(scale_factor=(1.7, 0.6), align_corners=True)),
    ((1, 6), dict(size=(4, 1), align_corners=True)),  # one-pixel axes
    ((16, 12), dict(size=(40, 30), align_corners=False)),  # two products
    ((9, 10), dict(scale_factor=(2.0, 1.5), align_corners=True)),
]


def _scales(resize):
    factor = resize.get('scale_factor')
    if factor is None:
        return None, None
    return tuple(factor) if isinstance(factor, tuple) else (factor, factor)


def _reference(x, grad_fn, resize):
    x = x.detach().requires_grad_(True)
    y = F.interpolate(x, mode='bilinear', **resize)
    g = grad_fn(y)
    return y.detach(), torch.autograd.grad(y, x, g)[0], g


@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-13),
                                       (torch.float32, 2e-6)])
@pytest.mark.parametrize('size,resize', RESIZES, ids=str)
def test_equals_interpolate_and_its_gradient(size, resize, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=gen, dtype=dtype)
    want_y, want_gx, g = _reference(
        x, lambda y: torch.randn(y.shape, generator=gen, dtype=dtype),
        resize)
    y = bilinear_gemm.resize(x, want_y.shape[2:], resize['align_corners'],
                             _scales(resize))
    gx = bilinear_gemm.resize_backward(g, size, resize['align_corners'],
                                       _scales(resize))
    # tolerance relative to the largest term a sum adds up
    torch.testing.assert_close(y, want_y, rtol=0, atol=tol * 4)
    bound = float(g.abs().amax()) * g.shape[2] * g.shape[3] / (
        size[0] * size[1])
    torch.testing.assert_close(gx, want_gx, rtol=0, atol=tol * 4 * bound)


def test_gradient_of_a_channel_slice_written_in_place():
    """A concatenation's channel slice (not contiguous over the batch) in,
    a contiguous slice of a larger gradient out (the resized loss's
    per-image write)."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 7, 16, 12, generator=gen, dtype=torch.float64)
    g = full[:, 2:5]
    assert not g.is_contiguous()
    want = torch.ops.aten.upsample_bilinear2d_backward(
        g.contiguous(), [16, 12], [2, 3, 4, 3], False, None, None)
    out = torch.full((3, 3, 4, 3), float('nan'), dtype=torch.float64)
    bilinear_gemm.resize_backward(g, (4, 3), False, out=out[1:])
    torch.testing.assert_close(out[1:], want, rtol=0, atol=1e-13)
    assert out[0].isnan().all()  # nothing outside the slice written


@pytest.mark.parametrize('source,products', [((6, 6), 1), ((16, 12), 2)])
def test_a_slice_gradient_is_read_in_place_by_one_or_two_products(
        source, products):
    """A small source (a pyramid branch's 6x6) is one batched GEMM each way,
    a larger one two; neither copies an operand (the matrices enter with a
    batch stride of 0, a channel slice of the gradient as it is)."""
    from mmseg_gf.accounting.launches import LaunchCounter, counting
    assert bilinear_gemm.one_product((48, 48), source) == (products == 1)
    x = torch.randn(2, 3, *source, dtype=torch.float64)
    full = torch.randn(2, 7, 48, 48, dtype=torch.float64)
    want = torch.ops.aten.upsample_bilinear2d_backward(
        full[:, 2:5].contiguous(), [48, 48], [2, 3, *source], False, None,
        None)
    bilinear_gemm.resize(x, (48, 48), False)  # the matrices, uncounted
    with counting(LaunchCounter()) as counter:
        bilinear_gemm.resize(x, (48, 48), False)
        got = bilinear_gemm.resize_backward(full[:, 2:5], source, False)
    ops = [launch.op for launch in counter.result.launches]
    assert len(ops) == 2 * products, ops
    assert all(op.startswith('aten.bmm') for op in ops), ops
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_matrix_rows_hold_two_weights_summing_to_one():
    """Each output pixel's row: at most two non-zero weights, on adjacent
    source pixels, adding up to 1 (the last source pixel's row: one)."""
    m = bilinear_gemm.interpolation_matrix(37, 5, False, None,
                                           torch.float64, 'cpu')
    assert m.shape == (37, 5)
    torch.testing.assert_close(m.sum(1), torch.ones(37, dtype=m.dtype))
    nonzero = (m != 0).sum(1)
    assert nonzero.max() <= 2 and (m >= 0).all()
    cols = [row.nonzero().flatten().tolist() for row in m]
    assert all(len(c) < 2 or c[1] == c[0] + 1 for c in cols)
    assert bilinear_gemm.interpolation_matrix(
        37, 5, False, None, torch.float64, 'cpu') is m  # cached


def test_cpu_tensors_keep_torchs_kernels_unless_counted_as_cuda():
    x = torch.zeros(1, 1, 2, 2)
    assert not bilinear_gemm.usable(x)
    with as_on_cuda():
        assert bilinear_gemm.usable(x)
        assert not bilinear_gemm.usable(x.half())
        with switches.override(MMSEG_GF_RESIZE_GEMM=False):
            assert not bilinear_gemm.usable(x)


# 'cuda': a GPU's tensors; 'counted': CPU tensors inside as_on_cuda (the
# launch count's stand-in for CUDA), which take the same route.
ROUTES = ['counted', pytest.param('cuda', marks=[pytest.mark.cuda,
                                                  needs_cuda])]


@pytest.mark.parametrize('route', ROUTES)
@pytest.mark.parametrize('size,resize', RESIZES, ids=str)
def test_resize_function_takes_the_products(size, resize, route,
                                            monkeypatch):
    """On CUDA the lean heads' resize (``BilinearResizeFunction``) runs the
    products both ways, with autograd's numbers within float32 rounding."""
    calls = []
    for name in ('resize', 'resize_backward'):
        real = getattr(bilinear_gemm, name)
        monkeypatch.setattr(bilinear_gemm, name,
                            lambda *a, _real=real, _name=name, **k:
                            calls.append(_name) or _real(*a, **k))
    device = 'cuda' if route == 'cuda' else 'cpu'
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, *size, generator=gen).to(device)
    want_y, want_gx, g = _reference(
        x, lambda y: torch.randn(y.shape, generator=gen).to(device), resize)
    leaf = x.clone().requires_grad_(True)
    with as_on_cuda() if route == 'counted' else contextlib.nullcontext():
        y = BilinearResizeFunction.apply(
            leaf, resize.get('size'), resize.get('scale_factor'),
            resize['align_corners'], None)
        gx, = torch.autograd.grad(y, leaf, g)
    assert calls == ['resize', 'resize_backward']
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('value', [float('nan'), float('inf'),
                                   -float('inf')])
@pytest.mark.parametrize('size, resize', RESIZES)
def test_a_non_finite_gradient_value_fills_its_plane(size, resize, value):
    """The stated difference from torch's kernel (module docstring): a
    non-finite value in one image-channel plane of the gradient makes that
    plane's whole input gradient non-finite (torch's: the input pixels the
    value's output pixel reads); every other plane is torch's."""
    x = torch.randn((2, 3) + size, dtype=torch.float64)
    y = F.interpolate(x, mode='bilinear', **resize)
    grad = torch.randn(y.shape, dtype=torch.float64)
    gen = torch.Generator().manual_seed(sum(size))
    i = int(torch.randint(y.shape[2], (1, ), generator=gen))
    j = int(torch.randint(y.shape[3], (1, ), generator=gen))
    grad[1, 2, i, j] = value
    want = _reference(x, lambda out: grad, resize)[1]
    got = bilinear_gemm.resize_backward(grad, size, resize['align_corners'],
                                        _scales(resize))
    bad_torch, bad_gemm = ~want.isfinite(), ~got.isfinite()
    assert bad_torch.any() and (bad_gemm | ~bad_torch).all()
    assert bad_gemm[1, 2].all() and bad_gemm.sum() == bad_gemm[1, 2].numel()
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1, :2], want[1, :2], rtol=1e-12,
                               atol=1e-12)
