"""Cases of the resized cross-entropy's Triton path
(``mmseg_gf.ops.resized_loss`` with ``triton_loss_kernels``); run by
``tests/test_ops/test_lean_triton.py`` in a subprocess (see
``tests/helpers/triton_cases.py``). Run directly::

    TRITON_INTERPRET=1 python -m pytest -q tests/helpers/triton_loss_cases.py

Compared with the PyTorch path (``use_kernel=False``): loss and gradient
to rounding, hits exactly. ``tests/test_ops/test_resized_loss.py`` holds
both against a float64 reference, and its CUDA variants take this path.
"""
import pytest
import torch

from mmseg_gf.ops import resized_loss, triton_loss_kernels
from mmseg_gf.ops.resized_loss import resized_cross_entropy
from tests.helpers.triton_runs import case_device, pytorch_path
from tests.helpers.triton_bit_mask_cases import _count

DEVICE = case_device()


def _case(n, c, h, w, size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, h, w, generator=gen) * 3
    label = torch.randint(0, c, (n, *size), generator=gen)
    label[0, :2] = 255
    weight = torch.rand(n, *size, generator=gen) + 0.5
    return logits, label, weight


# (sigmoid, align_corners, weighted, channels-last logits, classes)
CASES = {'softmax': (False, False, True, False, 5),
         'softmax_aligned_channels_last': (False, True, False, True, 5),
         'sigmoid': (True, False, True, False, 5),
         'softmax_150_classes': (False, False, True, False, 150)}


def _on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize('case', sorted(CASES))
def test_matches_the_pytorch_path(case):
    sigmoid, align_corners, weighted, channels_last, classes = CASES[case]
    logits, label, weight = _case(2, classes, 4, 3, (9, 7))
    if channels_last:
        logits = logits.contiguous(memory_format=torch.channels_last)
    weight = weight if weighted else None
    kwargs = dict(align_corners=align_corners, want_pixels=True,
                  sigmoid=sigmoid)
    with pytorch_path():
        want = resized_cross_entropy(logits, label, weight=weight,
                                     use_kernel=False, **kwargs)
    counted = (triton_loss_kernels, ('_pixel_cross_entropy', ))
    on_device = _on_device(logits, label)  # the copies are not counted
    weight_on = _on_device(weight)[0]
    run = _count(lambda: resized_cross_entropy(
        *on_device, weight=weight_on, **kwargs), *counted)
    got = run.result
    assert run.triton == ['_pixel_cross_entropy'] * 2
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-6, atol=0)
    assert torch.equal(got.hits.cpu(), want.hits)
    scale = float(want.grad.abs().max())
    torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5,
                               atol=1e-6 * scale)
    torch.testing.assert_close(got.pixel_loss.cpu(), want.pixel_loss,
                               rtol=1e-5, atol=1e-6)
    if sigmoid:
        assert got.target_prob is None
    else:
        torch.testing.assert_close(got.target_prob.cpu(), want.target_prob,
                                   rtol=1e-5, atol=1e-7)


def test_launches_per_image(monkeypatch):
    """The Triton path's launches: per image the upsampling, the kernel,
    the upsampling's backward; then the two sums. (``check_labels``, which
    the CPU runs first, is not run on a GPU, where the kernel counts bad
    labels and one assertion reads the count: 3 ops, counted there; so is
    ``resized_cross_entropy``'s CPU-only recount of non-finite logits.)"""
    logits, label, _ = _case(2, 4, 3, 3, (6, 5))
    if DEVICE == 'cpu':
        monkeypatch.setattr(resized_loss, 'check_labels',
                            lambda *args: None)
    on_device = _on_device(logits, label)  # the copies are not counted
    run = _count(lambda: resized_loss._per_image_triton(
        *on_device, 255, False, None, True, False, False),
        triton_loss_kernels, ('_pixel_cross_entropy', ))
    per_image = ['upsample_bilinear2d', 'upsample_bilinear2d_backward']
    tail = ['sum', 'sum'] + ([] if DEVICE == 'cpu' else
                             ['eq', 'all', '_assert_async'])
    assert run.triton == ['_pixel_cross_entropy'] * 2
    assert sorted(run.ops) == sorted(per_image * 2 + tail), run.ops


def test_kernel_counts_bad_labels_and_ranks_nan_first():
    """Labels outside ``[0, C)`` (not ignored) are counted, never read
    by index; NaN ranks first and the first of equal maxima wins, as
    ``argmax`` counts hits."""
    up = torch.randn(1, 4, 2, 4)
    up[0, 2, 0, 1] = float('nan')
    up[0, 1:3, 1, 2] = float('inf')
    label = torch.tensor([[2, 2, 5, -1], [255, 0, 1, 3]])
    parts = triton_loss_kernels.programs(4, 8)
    loss_part, hits_part, bad_part = (
        torch.zeros(parts, dtype=d, device=DEVICE)
        for d in (torch.float32, torch.int32, torch.int32))
    triton_loss_kernels.pixel_cross_entropy(
        up.to(DEVICE), label.to(DEVICE), None, None, loss_part, hits_part,
        bad_part, None, None, 255, False)
    assert int(bad_part.sum()) == 2
    ok = (label >= 0) & (label < 4)
    top = up.argmax(1)[0]
    assert int(hits_part.sum()) == int((top.eq(label) & ok).sum())
