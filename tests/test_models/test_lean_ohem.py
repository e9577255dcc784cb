"""PIDHead's and DDRHead's lean losses (mmseg_gf.models.lean_ohem) against
mmseg's own ``loss_by_feat`` and ``OhemCrossEntropy`` under autograd: the
same values and the same gradients w.r.t. the low-resolution logits, in
float64 and float32 (tiny shapes)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip('mmseg')

from mmseg.models.decode_heads import DDRHead, PIDHead  # noqa: E402
from mmseg.models.losses import OhemCrossEntropy  # noqa: E402
from tests.helpers.loss_checks import seg_samples  # noqa: E402

from mmseg_gf.models.lean_head import (fused_classifier_losses,  # noqa: E402
                                       lean_head_losses)
from mmseg_gf.models.lean_ohem import (label_probabilities,  # noqa: E402
                                       logit_gradients_at,
                                       ohem_cross_entropy, own_loss_producer)

CLASSES = 5
LOW, FULL = (4, 5), (15, 18)
WEIGHTS = [0.8, 1.1, 0.9, 1.3, 1.0]
DTYPES = (torch.float64, torch.float32)


def _tolerances(dtype):
    return dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else \
        dict(rtol=1e-10, atol=1e-13)


def _logits(dtype, channels=CLASSES, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(2, channels, *LOW, generator=gen)).to(dtype)


def _label(seed=1, ignored=0.0):
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, CLASSES, (2, *FULL), generator=gen)
    drop = torch.rand(label.shape, generator=gen) < ignored
    return torch.where(drop, 255, label)


def _mmseg_ohem(loss, logits, label, align_corners):
    leaf = logits.detach().requires_grad_(True)
    up = F.interpolate(leaf, size=label.shape[-2:], mode='bilinear',
                       align_corners=align_corners)
    value = loss(up, label)
    grad = torch.autograd.grad(value, leaf)[0] if value.requires_grad \
        else None
    return value.detach(), grad


def _lean_ohem(loss, logits, label, align_corners):
    first = label_probabilities(logits, label, 255, align_corners)
    value, term = ohem_cross_entropy(logits, label, first.target_prob, loss,
                                     align_corners, True)
    return value, None if term is None else term[0] * term[1]


OHEM_CASES = {
    # thres binds: every labelled pixel under 0.9 is kept
    'thres binds': dict(thres=0.9, min_kept=50),
    # min_kept binds: the min_kept-th smallest probability is the threshold
    'min_kept binds': dict(thres=0.01, min_kept=300),
    'min_kept above the labelled pixels': dict(thres=0.05, min_kept=10**6),
    'class weights, loss weight': dict(thres=0.7, min_kept=300,
                                       class_weight=WEIGHTS,
                                       loss_weight=0.4),
}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('ignored', [0.0, 0.3])
@pytest.mark.parametrize('case', list(OHEM_CASES))
@pytest.mark.parametrize('align_corners', [False, True])
def test_ohem_equals_mmseg(case, ignored, dtype, align_corners):
    loss = OhemCrossEntropy(**OHEM_CASES[case])
    logits, label = _logits(dtype), _label(ignored=ignored)
    want, want_grad = _mmseg_ohem(loss, logits, label, align_corners)
    got, got_grad = _lean_ohem(loss, logits, label, align_corners)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **_tolerances(dtype))
    torch.testing.assert_close(got_grad, want_grad, **_tolerances(dtype))


def test_ohem_case_kinds():
    """The cases select what their names say (float64)."""
    logits, label = _logits(torch.float64), _label()
    prob = label_probabilities(logits, label, 255, False).target_prob
    assert (prob < 0.9).sum() > 50  # thres binds
    assert float(prob.flatten().kthvalue(301).values) > 0.01  # min_kept
    assert label.numel() < 10**6


def test_ohem_without_labelled_pixels_is_constant_zero():
    loss = OhemCrossEntropy(thres=0.9, min_kept=10)
    logits = _logits(torch.float32)
    label = torch.full((2, *FULL), 255)
    want, want_grad = _mmseg_ohem(loss, logits, label, False)
    got, got_grad = _lean_ohem(loss, logits, label, False)
    assert want_grad is None and got_grad is None
    assert float(want) == float(got) == 0.0


def test_ohem_selecting_nothing_is_nan_with_zero_gradient():
    """One labelled pixel, ``thres`` 0: the threshold is that pixel's own
    probability and ``pred < threshold`` keeps nothing."""
    loss = OhemCrossEntropy(thres=0.0, min_kept=10)
    logits = _logits(torch.float64)
    label = torch.full((2, *FULL), 255)
    label[1, 3, 4] = 2
    want, want_grad = _mmseg_ohem(loss, logits, label, False)
    got, got_grad = _lean_ohem(loss, logits, label, False)
    assert torch.isnan(want) and torch.isnan(got)
    assert not want_grad.any() and not got_grad.any()


def _samples_of_label(ignored=0.0, seed=1):
    """Samples carrying :func:`_label`'s batch (drawn whole, a random
    fraction ``ignored``, as the loss-level checks above draw it) and
    edge maps from a second generator."""
    label = _label(seed, ignored)
    gen = torch.Generator().manual_seed(seed + 7)
    edges = torch.randint(0, 2, label.shape, generator=gen)
    return seg_samples([label[i:i + 1] for i in range(label.shape[0])],
                       [edges[i:i + 1] for i in range(label.shape[0])])


def _ohem_cfg(weight, class_weight, min_kept=150):
    return dict(type='OhemCrossEntropy', thres=0.9, min_kept=min_kept,
                class_weight=class_weight, loss_weight=weight)


def pid_head(class_weight=WEIGHTS, min_kept=150, align_corners=True):
    return PIDHead(in_channels=8, channels=8, num_classes=CLASSES,
                   align_corners=align_corners, loss_decode=[
                       dict(type='CrossEntropyLoss', use_sigmoid=False,
                            class_weight=class_weight, loss_weight=0.4),
                       _ohem_cfg(1.0, class_weight, min_kept),
                       dict(type='BoundaryLoss', loss_weight=20.0),
                       _ohem_cfg(1.0, class_weight, min_kept)])


def ddr_head(class_weight=WEIGHTS, min_kept=150, align_corners=False):
    return DDRHead(in_channels=8, channels=8, num_classes=CLASSES,
                   align_corners=align_corners, loss_decode=[
                       _ohem_cfg(1.0, class_weight, min_kept),
                       _ohem_cfg(0.4, class_weight, min_kept)])


def _head_logits(head, dtype):
    channels = (CLASSES, CLASSES, 1) if isinstance(head, PIDHead) \
        else (CLASSES, CLASSES)
    # the boundary logits near 0.8's logit, so that the gate splits pixels
    return tuple(_logits(dtype, c, seed=10 + i, scale=3.0 if c > 1 else 1.0)
                 + (1.4 if c == 1 else 0.0)
                 for i, c in enumerate(channels))


def _losses_and_grads(run, logits):
    leaves = tuple(t.detach().requires_grad_(True) for t in logits)
    out = run(leaves)
    grads = {}
    for key, value in out.items():
        if 'loss' in key and value.requires_grad:
            grads[key] = torch.autograd.grad(value, leaves,
                                             allow_unused=True,
                                             retain_graph=True)
    return {k: v.detach() for k, v in out.items()}, grads


def _check_head(head, dtype, samples):
    head.train()
    logits = _head_logits(head, dtype)
    want, want_grads = _losses_and_grads(
        lambda leaves: head.loss_by_feat(leaves, samples), logits)
    got, got_grads = _losses_and_grads(
        lambda leaves: lean_head_losses(head, leaves, samples), logits)
    assert list(got) == list(want)
    tol = _tolerances(dtype)
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], **tol,
                                   msg=lambda m: f'{key}: {m}')
    assert got_grads.keys() == want_grads.keys()
    for key, per in want_grads.items():
        for i, (g, w) in enumerate(zip(got_grads[key], per)):
            if w is None or not w.any():
                assert g is None or not g.any(), (key, i)
            else:
                torch.testing.assert_close(g, w, **tol,
                                           msg=lambda m: f'{key}[{i}]: {m}')
    return got, want_grads


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('min_kept', [150, 10**6])
def test_pid_head_equals_mmseg(dtype, min_kept):
    head = pid_head(min_kept=min_kept)
    assert own_loss_producer(head, PIDHead, (0, 0, 0), []) is not None
    got, grads = _check_head(head, dtype, _samples_of_label())
    # the boundary gate splits the pixels: loss_sem_bd is a real subset
    assert 0 < float(got['loss_sem_bd']) and grads['loss_sem_bd'][1].any()
    assert grads['loss_bd'][2].any()


@pytest.mark.parametrize('dtype', DTYPES)
def test_pid_head_ignored_pixels_without_class_weights(dtype):
    """mmseg's CrossEntropyLoss with class weights indexes them with every
    label (an ignored one fails); without, ignored pixels are fine."""
    _check_head(pid_head(class_weight=None, align_corners=False), dtype,
                _samples_of_label(ignored=0.3))


def test_pid_head_class_weights_with_ignored_pixels():
    """mmseg 1.2.2's CrossEntropyLoss with class weights raises an
    IndexError on an ignored pixel; the lean loss weighs them 0: PyTorch's
    class-weighted mean cross-entropy of the upsampled logits."""
    head = pid_head()
    samples = _samples_of_label(ignored=0.3)
    logits = _head_logits(head, torch.float32)
    with pytest.raises(IndexError):
        head.loss_by_feat(logits, samples)
    got = lean_head_losses(head, logits, samples)['loss_sem_p']
    label = head._stack_batch_gt(samples)[0][:, 0]
    up = F.interpolate(logits[0], size=label.shape[-2:], mode='bilinear',
                       align_corners=head.align_corners)
    want = 0.4 * F.cross_entropy(up, label, weight=torch.tensor(WEIGHTS),
                                 ignore_index=255)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('ignored', [0.0, 0.3])
@pytest.mark.parametrize('min_kept', [150, 10**6])
def test_ddr_head_equals_mmseg(dtype, ignored, min_kept):
    head = ddr_head(min_kept=min_kept)
    assert own_loss_producer(head, DDRHead, (0, 0), []) is not None
    _check_head(head, dtype, _samples_of_label(ignored=ignored))


def test_ddr_head_all_ignored():
    head = ddr_head()
    samples = _samples_of_label(ignored=1.0)
    got, grads = _check_head(head, torch.float32, samples)
    assert float(got['loss_context']) == 0.0 and not grads


def test_other_losses_keep_the_plain_path():
    head = ddr_head()
    head.loss_decode[1] = torch.nn.Module()
    assert own_loss_producer(head, DDRHead, (0, 0), []) is None
    head = ddr_head()
    head.loss_decode[0].ignore_label = 254
    assert own_loss_producer(head, DDRHead, (0, 0), []) is None
    head = pid_head()
    head.loss_decode[0].use_sigmoid = True
    assert own_loss_producer(head, PIDHead, (0, 0, 0), []) is None
    assert own_loss_producer(pid_head(), DDRHead, (0, 0, 0), []) is None
    assert own_loss_producer(pid_head(), PIDHead, (0, 0), []) is None


@pytest.mark.parametrize('head_fn,position', [(pid_head, 1), (ddr_head, 0)])
def test_logit_gradients_at_the_classifier(head_fn, position):
    """The classifier's output gets one basis per loss that reads it, the
    other logits their scaled gradients: together mmseg's gradients."""
    head = head_fn()
    samples = _samples_of_label()
    logits = _head_logits(head, torch.float64)
    _, want = _losses_and_grads(
        lambda leaves: head.loss_by_feat(leaves, samples), logits)
    producer = own_loss_producer(head, type(head), logits, samples)
    rest = [t.requires_grad_(True) for i, t in enumerate(logits)
            if i != position]
    result = logit_gradients_at(producer, position, logits[position], rest)
    assert len(result.bases) == (2 if position == 1 else 1)
    for key, per in want.items():
        z = per[position]
        if key in result.mix:
            got = sum(c * result.bases[b] for b, c in result.mix[key])
            torch.testing.assert_close(got, z)
        else:
            assert z is None or not z.any()
        others = [g for i, g in enumerate(per) if i != position]
        for g, w in zip(result.others[key], others):
            if w is None:
                assert g is None
            else:
                torch.testing.assert_close(g, w)


def test_fused_classifier_losses_use_the_own_producer(monkeypatch):
    """The fused path goes through :func:`logit_gradients_at`, not
    autograd over mmseg's ``loss_by_feat``."""
    import mmseg_gf.models.lean_head as lean_head
    calls = []

    def spy(*args):
        calls.append(args[1])
        return logit_gradients_at(*args)

    monkeypatch.setattr(lean_head, 'logit_gradients_at', spy)
    monkeypatch.setattr(lean_head, '_logit_gradients', None)
    head = ddr_head()
    head.train()
    samples = _samples_of_label()
    capture = lean_head.ClassifierCapture()
    feat = torch.randn(2, 8, *LOW, requires_grad=True)
    z = capture.classify(head, feat)
    spatial = _logits(torch.float32).requires_grad_(True)
    out = fused_classifier_losses(head, capture, (z, spatial), samples)
    assert calls == [0]
    sum(v for k, v in out.items() if 'loss' in k).backward()
    assert feat.grad is not None and spatial.grad is not None


@pytest.mark.parametrize('head_fn', [pid_head, ddr_head])
def test_heads_under_bfloat16_autocast(head_fn):
    """Under CPU autocast (bfloat16 logits) the values are mmseg's float32
    ones (the same selection) and the gradients bfloat16, within its
    rounding."""
    head = head_fn(class_weight=None)
    head.train()
    samples = _samples_of_label(ignored=0.2)
    logits = tuple(t.to(torch.bfloat16)
                   for t in _head_logits(head, torch.float32))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        want, want_grads = _losses_and_grads(
            lambda leaves: head.loss_by_feat(leaves, samples), logits)
        got, got_grads = _losses_and_grads(
            lambda leaves: lean_head_losses(head, leaves, samples), logits)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    for key, per in want_grads.items():
        for g, w in zip(got_grads[key], per):
            if w is not None:
                assert g.dtype == w.dtype == torch.bfloat16
                torch.testing.assert_close(
                    g.float(), w.float(), rtol=0,
                    atol=2 ** -5 * float(w.float().abs().max()))
