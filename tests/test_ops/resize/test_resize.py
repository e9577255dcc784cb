"""mmseg_gf.ops.resize.bilinear: bilinear resizes under ``strided_gradient_resizes``
give autograd's outputs, and its gradients (bit for bit on torch's kernel;
within float32 rounding on the compiled one-axis-at-a-time kernel), read a
channel slice's gradient without copying it, and leave every other
``interpolate`` call to torch."""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops.backend import availability
from mmseg_gf.ops.resize import cpu as resize_cpu
from mmseg_gf.ops.resize.bilinear import (BilinearResizeFunction,
                                          bilinear_resize_backward,
                                          strided_gradient_resizes)
from mmseg_gf.models.head_resizes import routed_resizes
from tests.helpers.devices import CUDA_AVAILABLE

RESIZES = [
    dict(size=(13, 11), align_corners=False),
    dict(size=(13, 11), align_corners=True),
    dict(size=(3, 4), align_corners=False),  # downsampling
    dict(scale_factor=2, align_corners=False),
    dict(scale_factor=(1.7, 0.6), align_corners=True),
    dict(scale_factor=1.7, align_corners=False, recompute_scale_factor=True),
]


def _head(x, other, **resize):
    """A head's pattern: resize, concatenate with another branch along the
    channels, a per-channel weighting after (so each channel slice's
    gradient differs)."""
    up = F.interpolate(x, mode='bilinear', **resize)
    other = F.interpolate(other, size=up.shape[2:], mode='bilinear',
                          align_corners=False)
    both = torch.cat([other, up, other], 1)
    weight = torch.arange(both.shape[1], dtype=x.dtype,
                          device=x.device).view(1, -1, 1, 1)
    return (both * weight).sin().sum(), up


# 'torch': the PyTorch path (kernels off), which 'cuda' tensors take too.
KERNELS = ['torch', pytest.param('compiled', marks=pytest.mark.skipif(
    not availability.native_available(), reason='compiled kernels not built')),
           pytest.param('cuda', marks=[pytest.mark.cuda, pytest.mark.skipif(
               not CUDA_AVAILABLE, reason='no CUDA GPU on this machine')])]


def _assert_same(got, want, kernel):
    """Bit for bit on torch's CPU kernel; within float32 rounding on the
    compiled one and on CUDA (whose kernel sums with atomics)."""
    if kernel == 'torch':
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('kernel', KERNELS)
@pytest.mark.parametrize('resize', RESIZES)
@pytest.mark.parametrize('layout', [torch.contiguous_format,
                                    torch.channels_last])
def test_same_outputs_and_gradients(resize, layout, kernel, switch_override):
    if kernel == 'torch':
        switch_override(MMSEG_GF_NATIVE=False)
    device = 'cuda' if kernel == 'cuda' else 'cpu'
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 4, 6, 5, generator=gen).contiguous(
        memory_format=layout).to(device)
    other0 = torch.randn(3, 2, 5, 5, generator=gen).to(device)
    results = []
    for routed in (False, True):
        x, other = x0.clone().requires_grad_(True), \
            other0.clone().requires_grad_(True)
        if routed:
            with strided_gradient_resizes():
                loss, up = _head(x, other, **resize)
            assert isinstance(up.grad_fn,
                              BilinearResizeFunction._backward_cls)
        else:
            loss, up = _head(x, other, **resize)
        loss.backward()
        results.append((up.detach(), x.grad, other.grad))
    for got, want in zip(results[1], results[0]):
        assert got.device.type == device
        _assert_same(got, want, kernel)


@pytest.mark.parametrize('kernel', KERNELS)
def test_a_channel_slice_gradient_is_not_copied(kernel, switch_override):
    """The gradient of the middle of a concatenation (non-contiguous for a
    batch) is read in place, image by image: no copy, torch's result."""
    if kernel == 'torch':
        switch_override(MMSEG_GF_NATIVE=False)
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(2, 9, 16, 16, generator=gen).to(
        'cuda' if kernel == 'cuda' else 'cpu')[:, 3:7]
    assert not grad.is_contiguous()
    with torch.profiler.profile() as prof:
        got = bilinear_resize_backward(grad, (2, 4, 8, 8), False,
                                       (None, None))
    names = [e.name for e in prof.events()]
    assert not {'aten::contiguous', 'aten::clone', 'aten::copy_'} & set(names)
    want = torch.ops.aten.upsample_bilinear2d_backward(
        grad.contiguous(), [16, 16], [2, 4, 8, 8], False)
    assert got.is_contiguous() and got.device == grad.device
    _assert_same(got, want, kernel)


@pytest.mark.skipif(not availability.native_available(), reason='compiled kernels not '
                    'built')
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('sizes', [((7, 9), (16, 21)), ((16, 21), (7, 9)),
                                   ((5, 5), (5, 5)), ((1, 6), (4, 1)),
                                   ((8, 8), (8, 17))])
@pytest.mark.parametrize('align_corners', [False, True])
def test_compiled_backward_equals_torchs_kernel(dtype, sizes, align_corners):
    """Up, down, the same size (torch copies), one-pixel axes, one axis
    only; float64 to 1e-12: the same terms, only summed in another
    order."""
    (hi, wi), (ho, wo) = sizes
    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(3, 4, ho, wo, generator=gen, dtype=dtype)
    for scales in ((None, None), (ho / hi * 1.01, wo / wi * 0.99)):
        if align_corners and scales[0] is not None:
            continue  # torch ignores the scales with align_corners
        want = torch.ops.aten.upsample_bilinear2d_backward(
            grad, [ho, wo], [3, 4, hi, wi], align_corners, *scales)
        got = resize_cpu.bilinear_backward(
            grad, torch.empty(3, 4, hi, wi, dtype=dtype), align_corners,
            scales)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize('routing', [strided_gradient_resizes,
                                     routed_resizes])
def test_other_interpolations_are_torchs(routing):
    """Under the mode (traced regions) and the ``F.interpolate`` route (eager
    lean heads) alike, only bilinear resizes that need a gradient change."""
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    with routing():
        nearest = F.interpolate(x, scale_factor=2, mode='nearest')
        with torch.no_grad():
            plain = F.interpolate(x, scale_factor=2, mode='bilinear')
        frozen = F.interpolate(x.detach(), scale_factor=2, mode='bilinear')
        smooth = F.interpolate(x, scale_factor=0.5, mode='bilinear',
                               antialias=True)
    assert 'Nearest' in type(nearest.grad_fn).__name__
    assert plain.grad_fn is None and frozen.grad_fn is None
    assert type(smooth.grad_fn).__name__.startswith('UpsampleBilinear2DAa')
