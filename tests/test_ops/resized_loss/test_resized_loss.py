"""The cross-entropy of upsampled logits (mmseg_gf.ops.resized_loss.loss) against
PyTorch's own upsampling and (softmax or one-hot binary) cross-entropy on
the whole batch in float64: both paths (the compiled kernel and the
per-image PyTorch path), upsampling and downsampling, both
``align_corners``, per-pixel weights, ignored pixels and bad labels."""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops.resized_loss import loss as resized_loss
from mmseg_gf.ops.resized_loss.loss import resized_cross_entropy
from tests.helpers.devices import needs_cuda

# use_kernel: False is the PyTorch path, which CUDA tensors take ('cuda').
PATHS = [False] + ([True] if resized_loss._kernel is not None else []) + [
    pytest.param('cuda', marks=[pytest.mark.cuda, needs_cuda])]


def _on(kernel):
    """``(device, use_kernel)`` of a path of :data:`PATHS`."""
    return ('cuda', None) if kernel == 'cuda' else ('cpu', kernel)


def _run(logits, label, kernel, weight=None, **kwargs):
    """``resized_cross_entropy`` on one path, its tensors back on the CPU."""
    device, use_kernel = _on(kernel)
    got = resized_cross_entropy(
        logits.to(device), label.to(device),
        weight=None if weight is None else weight.to(device),
        use_kernel=use_kernel, **kwargs)
    for key, value in vars(got).items():
        if value is not None:
            assert value.device.type == device, key
            setattr(got, key, value.cpu())
    return got

# (N, C, h, w, H, W): 4x and odd upsampling, same size, downsampling, 1x1
SHAPES = [(2, 5, 7, 9, 28, 36), (2, 19, 16, 12, 61, 47), (1, 3, 8, 8, 8, 8),
          (1, 4, 10, 13, 5, 6), (2, 2, 1, 1, 4, 3), (1, 150, 6, 5, 24, 20)]


def _expected(logits, label, weight, ignore_index, align_corners,
              sigmoid=False):
    """float64 reference: F.interpolate, then F.cross_entropy or
    F.binary_cross_entropy_with_logits on one-hot labels, batch at once."""
    z = logits.double().requires_grad_(True)
    up = F.interpolate(z, size=label.shape[-2:], mode='bilinear',
                       align_corners=align_corners)
    valid = label != ignore_index
    if sigmoid:
        onehot = F.one_hot(torch.where(valid, label, 0), up.shape[1])
        ce = F.binary_cross_entropy_with_logits(
            up, onehot.permute(0, 3, 1, 2).double(), reduction='none')
        ce = torch.where(valid, ce.sum(1), 0.0)
    else:
        ce = F.cross_entropy(up, label, reduction='none',
                             ignore_index=ignore_index)
    w = valid.double() if weight is None else weight.double() * valid
    loss = (ce * w).flatten(1).sum(1)
    loss.sum().backward()
    up = up.detach()
    hits = (up.argmax(1).eq(label) & valid).flatten(1).sum(1)
    prob = up.softmax(1).gather(1, label.clamp(0, up.shape[1] - 1)[:, None])
    return dict(loss=loss.detach(), grad=z.grad, hits=hits,
                pixel_loss=ce.detach(),
                target_prob=torch.where(valid, prob[:, 0], 0.0))


def _case(shape, seed=0, ignored=True):
    n, c, h, w, H, W = shape
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, h, w, generator=g) * 3
    label = torch.randint(0, c, (n, H, W), generator=g)
    if ignored:
        label[0, :max(1, H // 4)] = 255
    weight = torch.rand(n, H, W, generator=g) + 0.5
    return logits, label, weight


@pytest.mark.parametrize('kernel', PATHS)
@pytest.mark.parametrize('sigmoid', [False, True])
@pytest.mark.parametrize('align_corners', [False, True])
@pytest.mark.parametrize('shape', SHAPES)
def test_matches_pytorch_float64(kernel, sigmoid, align_corners, shape):
    logits, label, weight = _case(shape)
    got = _run(logits, label, kernel, weight, align_corners=align_corners,
               want_pixels=True, sigmoid=sigmoid)
    want = _expected(logits, label, weight, 255, align_corners, sigmoid)
    assert got.grad.dtype == torch.float32 and got.loss.dtype == torch.float64
    torch.testing.assert_close(got.loss, want['loss'], rtol=1e-6, atol=0)
    scale = float(want['grad'].abs().max())
    torch.testing.assert_close(got.grad.double(), want['grad'], rtol=1e-5,
                               atol=1e-6 * scale)
    assert torch.equal(got.hits, want['hits'])
    torch.testing.assert_close(got.pixel_loss.double(), want['pixel_loss'],
                               rtol=1e-5, atol=1e-6)
    if sigmoid:
        assert got.target_prob is None
        return
    torch.testing.assert_close(got.target_prob.double(), want['target_prob'],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('kernel', PATHS)
def test_unweighted_and_without_gradient(kernel):
    logits, label, _ = _case((2, 6, 9, 7, 36, 28), seed=3)
    want = _expected(logits, label, None, 255, False)
    full = _run(logits, label, kernel)
    bare = _run(logits, label, kernel, want_grad=False)
    assert bare.grad is None and bare.pixel_loss is None
    torch.testing.assert_close(full.loss, want['loss'], rtol=1e-6, atol=0)
    torch.testing.assert_close(bare.loss, full.loss, rtol=0, atol=0)
    torch.testing.assert_close(full.grad.double(), want['grad'], rtol=1e-5,
                               atol=1e-6 * float(want['grad'].abs().max()))


@pytest.mark.parametrize('kernel', PATHS)
def test_all_ignored_image_and_zero_weights(kernel):
    logits, label, weight = _case((2, 4, 5, 5, 20, 20), seed=1)
    label[1] = 255
    weight[0, 10:] = 0.0
    got = _run(logits, label, kernel, weight, want_pixels=True)
    assert float(got.loss[1]) == 0.0 and int(got.hits[1]) == 0
    assert not got.grad[1].any() and not got.pixel_loss[1].any()
    want = _expected(logits, label, weight, 255, False)
    torch.testing.assert_close(got.grad.double(), want['grad'], rtol=1e-5,
                               atol=1e-6 * float(want['grad'].abs().max()))


@pytest.mark.parametrize('kernel', PATHS)
def test_other_ignore_index(kernel):
    logits, label, _ = _case((1, 5, 6, 6, 12, 12), seed=4, ignored=False)
    got = _run(logits, label, kernel, ignore_index=2)
    want = _expected(logits, label, None, 2, False)
    torch.testing.assert_close(got.loss, want['loss'], rtol=1e-6, atol=0)
    assert torch.equal(got.hits, want['hits'])


# Not on CUDA: there the check is a device-side assertion (no host sync),
# which a CUDA context does not survive.
@pytest.mark.parametrize('kernel', PATHS[:-1])
def test_label_out_of_range_is_refused(kernel):
    logits, label, _ = _case((1, 3, 4, 4, 8, 8))
    label[0, 5, 5] = 3
    with pytest.raises(ValueError, match=r'\[0, 3\)'):
        _run(logits, label, kernel)


@pytest.mark.parametrize('kernel', PATHS[:-1])  # not on CUDA: see above
def test_label_out_of_range_is_a_label_range_error(kernel):
    """Bad data has its own error type (a ValueError), which the lean
    loss tells apart from a loss it cannot mirror."""
    logits, label, _ = _case((1, 3, 4, 4, 8, 8))
    label[0, 1, 1] = -1
    device, use_kernel = _on(kernel)
    with pytest.raises(resized_loss.LabelRangeError):
        resized_cross_entropy(logits.to(device), label.to(device),
                              use_kernel=use_kernel)


def _topk_hits(logits, label, ignore_index, align_corners):
    """mmseg's ``accuracy`` count: top-1 of ``topk`` (not ``argmax``)
    over the classes of the upsampled logits."""
    up = F.interpolate(logits, size=label.shape[-2:], mode='bilinear',
                       align_corners=align_corners)
    top = up.topk(1, dim=1).indices[:, 0]
    return (top.eq(label) & (label != ignore_index)).flatten(1).sum(1)


@pytest.mark.parametrize('kernel', PATHS)
@pytest.mark.parametrize('sigmoid', [False, True])
def test_non_finite_logits_count_hits_as_mmseg_accuracy(kernel, sigmoid):
    """NaN in every class, in one class, and equal infinities: the hits
    are those of mmseg's ``accuracy`` (``topk`` on the logits' device), on
    every path; an image with finite logits keeps its count."""
    logits, label, _ = _case((3, 5, 6, 7, 24, 28), seed=6)
    logits[0, :, 1, 2] = float('nan')
    logits[0, 3, 4, 5] = float('nan')
    logits[1, 1:4, 2, 2] = float('inf')
    device, use_kernel = _on(kernel)
    logits, label = logits.to(device), label.to(device)
    out = resized_cross_entropy(logits, label, use_kernel=use_kernel,
                                sigmoid=sigmoid, want_grad=False)
    want = _topk_hits(logits, label, 255, False)
    assert out.hits.tolist() == want.tolist()
    if device == 'cpu':
        # the case differs from the CPU's argmax count, else it would prove
        # nothing (CUDA's argmax and topk agree on NaN)
        argmax = (F.interpolate(logits, size=label.shape[-2:],
                                mode='bilinear').argmax(1).eq(label)
                  & (label != 255)).flatten(1).sum(1)
        assert argmax[:2].tolist() != want[:2].tolist()


def test_bad_shapes_are_refused():
    logits, label, weight = _case((2, 3, 4, 4, 8, 8))
    with pytest.raises(ValueError, match='N x H x W'):
        resized_cross_entropy(logits, label[:1])
    with pytest.raises(ValueError, match='label\'s shape'):
        resized_cross_entropy(logits, label, weight=weight[:, :4])


@pytest.mark.skipif(resized_loss._kernel is None,
                    reason='compiled kernel not built')
def test_kernel_propagates_nan_and_falls_back_off_float32():
    logits, label, _ = _case((1, 4, 4, 4, 8, 8), ignored=False)
    logits[0, 2, 1, 1] = float('nan')
    got = resized_cross_entropy(logits, label, use_kernel=True)
    assert torch.isnan(got.loss).all()
    assert not resized_loss.kernel_usable(logits.double())
    with pytest.raises(RuntimeError, match='float32 CPU'):
        resized_cross_entropy(logits.double(), label, use_kernel=True)


@pytest.mark.skipif(resized_loss._kernel is None,
                    reason='compiled kernel not built')
def test_kernel_switched_off_by_environment(switch_override):
    logits, label, _ = _case((1, 3, 4, 4, 8, 8))
    assert resized_loss.kernel_usable(logits)
    switch_override(MMSEG_GF_NATIVE=False)
    assert not resized_loss.kernel_usable(logits)


@pytest.mark.parametrize('kernel', PATHS)
@pytest.mark.parametrize('sigmoid', [False, True])
def test_large_logits(kernel, sigmoid):
    """Logits of +-100: the softmax's and the softplus' range reduction."""
    logits, label, _ = _case((1, 7, 6, 5, 24, 20), seed=5)
    logits = logits * 30
    got = _run(logits, label, kernel, sigmoid=sigmoid)
    want = _expected(logits, label, None, 255, False, sigmoid)
    torch.testing.assert_close(got.loss, want['loss'], rtol=1e-6, atol=0)
    torch.testing.assert_close(got.grad.double(), want['grad'], rtol=1e-5,
                               atol=1e-6 * float(want['grad'].abs().max()))
