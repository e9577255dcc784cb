"""Cases of the resized cross-entropy's Triton path
(``mmseg_gf.ops.resized_loss.loss`` with ``triton_loss_kernels``); run by
``tests/test_ops/lean/test_lean_triton.py`` in a subprocess (see
``tests/helpers/triton_cases.py``). Run directly::

    TRITON_INTERPRET=1 python -m pytest -q tests/helpers/triton_loss_cases.py

Compared with the PyTorch path (``use_kernel=False``): loss and gradient
to rounding, hits exactly. ``tests/test_ops/resized_loss/test_resized_loss.py`` holds
both against a float64 reference, and its CUDA variants take this path.
"""
import pytest
import torch

from mmseg_gf.ops.resized_loss import (loss as resized_loss,
                                       kernels as triton_loss_kernels,
                                       traced as traced_loss)
from mmseg_gf.ops.resized_loss.loss import accuracy, resized_cross_entropy
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
    counted = (triton_loss_kernels, _KERNELS)
    on_device = _on_device(logits, label)  # the copies are not counted
    weight_on = _on_device(weight)[0]
    run = _count(lambda: resized_cross_entropy(
        *on_device, weight=weight_on, **kwargs), *counted)
    got = run.result
    assert run.triton == ['_pixel_cross_entropy'] * 2 + ['_batch_totals']
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-6, atol=0)
    assert torch.equal(got.hits.cpu(), want.hits)
    _check_totals(got.totals, want, label)
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


_KERNELS = ('_pixel_cross_entropy', '_batch_totals')


def _check_totals(totals, want, label):
    """The batch's totals of the Triton path against the PyTorch path's
    per-image results: the loss to rounding (its sum's order), the hits,
    labelled pixels and accuracy exactly (mmseg's arithmetic)."""
    torch.testing.assert_close(totals.loss.cpu(),
                               want.loss.sum().float(), rtol=1e-6, atol=0)
    hits = want.hits.sum().float()
    assert torch.equal(totals.hits.cpu(), hits)
    labelled = (label != 255).sum()
    assert torch.equal(totals.labelled.cpu(), labelled)
    assert torch.equal(totals.accuracy.cpu(), accuracy(hits, labelled))


def test_launches_per_image(monkeypatch):
    """The Triton path's launches: per image the upsampling, the kernel,
    the upsampling's backward (two GEMMs on CUDA); then one kernel for the batch's totals.
    (``check_labels``, which the CPU runs first, is not run on a GPU, where
    the kernels count bad labels and one assertion reads the count: 2
    ops, counted there; so is ``resized_cross_entropy``'s CPU-only
    recount of non-finite logits.)"""
    logits, label, _ = _case(2, 4, 3, 3, (6, 5))
    if DEVICE == 'cpu':
        monkeypatch.setattr(resized_loss, 'check_labels',
                            lambda *args: None)
    on_device = _on_device(logits, label)  # the copies are not counted
    # once uncounted: a first call builds (and caches) the GEMM route's
    # interpolation matrices
    resized_loss.triton_loss(*on_device, 255, False, None, True,
                                   False, False)
    run = _count(lambda: resized_loss.triton_loss(
        *on_device, 255, False, None, True, False, False),
        triton_loss_kernels, _KERNELS)
    # the upsampling's backward: on CUDA two GEMMs (ops.resize.gemm)
    per_image = ['upsample_bilinear2d'] + (
        ['upsample_bilinear2d_backward'] if DEVICE == 'cpu' else
        ['mm', 'bmm'])
    tail = [] if DEVICE == 'cpu' else ['eq', '_assert_async']
    assert run.triton == ['_pixel_cross_entropy'] * 2 + ['_batch_totals']
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
    loss_part, hits_part, bad_part, valid_part = (
        torch.zeros(parts, dtype=d, device=DEVICE)
        for d in (torch.float32, torch.int32, torch.int32, torch.int32))
    triton_loss_kernels.pixel_cross_entropy(
        up.to(DEVICE), label.to(DEVICE), None, None, loss_part, hits_part,
        bad_part, valid_part, None, None, 255, False)
    assert int(bad_part.sum()) == 2
    assert int(valid_part.sum()) == 7
    ok = (label >= 0) & (label < 4)
    top = up.argmax(1)[0]
    assert int(hits_part.sum()) == int((top.eq(label) & ok).sum())


def test_batch_totals_flag_bad_labels():
    """The totals count the bad labels of every partial sum."""
    parts = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    bad = parts.clone()
    bad[2, 3] = 1
    outs = [torch.empty(3, dtype=torch.float64, device=DEVICE),
            torch.empty(3, dtype=torch.int64, device=DEVICE),
            *(torch.empty((), dtype=d, device=DEVICE) for d in (
                torch.float32, torch.float32, torch.int64)),
            torch.empty(1, dtype=torch.float32, device=DEVICE),
            torch.empty((), dtype=torch.int32, device=DEVICE)]
    triton_loss_kernels.batch_totals(parts.float(), parts, bad, parts + 1,
                                     *outs)
    assert int(outs[-1]) == 1 and int(outs[4]) == 12
    triton_loss_kernels.batch_totals(parts.float(), parts, parts, parts,
                                     *outs)
    assert int(outs[-1]) == 0


@pytest.mark.parametrize('avg_non_ignore', [False, True])
def test_lean_loss_values_match_the_pytorch_path(avg_non_ignore):
    """mmseg's loss and accuracy from the batch's totals (one launch)
    equal those the PyTorch path assembles from the per-image results:
    the loss to rounding, the accuracy exactly; the gradient basis too."""
    from mmseg_gf.models.lean_loss import chunked_cross_entropy_gradients
    logits, label, _ = _case(2, 5, 4, 3, (9, 7))
    specs = [('loss_ce', 0.4, 'mean', avg_non_ignore, False, None)]
    with pytorch_path():
        want = chunked_cross_entropy_gradients(logits, label, False, 255,
                                               specs)
    logits_on, label_on = _on_device(logits, label)
    got = chunked_cross_entropy_gradients(logits_on, label_on, False, 255,
                                          specs)
    assert torch.equal(got.values['acc_seg'].cpu(), want.values['acc_seg'])
    torch.testing.assert_close(got.values['loss_ce'].cpu(),
                               want.values['loss_ce'], rtol=1e-6, atol=0)
    assert got.mix == want.mix
    torch.testing.assert_close(got.bases[0].cpu(), want.bases[0],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('sigmoid', [False, True])
def test_operator_takes_the_triton_kernel(sigmoid):
    """``mmseg_gf::resized_cross_entropy`` on the Triton path: opcheck (its
    fake and autograd formula included), and under ``torch.compile``
    (``fullgraph=True``) the eager Triton path's loss, hits and gradient."""
    logits, label, weight = _on_device(*_case(2, 5, 4, 3, (9, 7)))
    assert resized_loss.operator_usable(logits)
    logits.requires_grad_()
    torch.library.opcheck(torch.ops.mmseg_gf.resized_cross_entropy,
                          (logits, label, weight, 255, False, sigmoid))
    scale = torch.tensor([1.0, 3.0], dtype=torch.float64, device=DEVICE)

    def loss(z):
        total, hits = traced_loss.traced_resized_cross_entropy(
            z, label, weight=weight, sigmoid=sigmoid)
        return total * scale, hits

    torch._dynamo.reset()
    got, hits = torch.compile(loss, backend='aot_eager',
                              fullgraph=True)(logits)
    grad, = torch.autograd.grad(got.sum(), logits)
    ref = resized_cross_entropy(logits, label, weight=weight,
                                sigmoid=sigmoid)
    assert ref.totals is not None  # eager mode took the Triton kernel
    torch.testing.assert_close(got, ref.loss * scale)
    assert torch.equal(hits, ref.hits)
    torch.testing.assert_close(grad, ref.grad * scale.float().view(
        2, 1, 1, 1))
