"""A decode head with mmseg's OHEMPixelSampler: the lean loss (hard pixels
from a first pass of label probabilities, then the weighted cross-entropy
with its gradient taken in the forward) against mmseg's own
``loss_by_feat`` on the whole batch: same values, same gradients."""
import copy

import pytest
import torch

pytest.importorskip('mmseg')

from mmseg.registry import MODELS  # noqa: E402

from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from tests.helpers.loss_checks import (  # noqa: E402
    assert_same_loss_by_feat, random_samples)
from mmseg_gf.models.lean import make_lean  # noqa: E402
from mmseg_gf.models.lean_loss import (chunkable_losses,  # noqa: E402
                                       ohem_sampler_spec)

CLASSES = 4


def _head(sampler, **loss):
    return MODELS.build(dict(
        type='FCNHead', in_channels=4, channels=4, num_convs=1,
        num_classes=CLASSES, align_corners=False, sampler=sampler,
        loss_decode=dict(type='CrossEntropyLoss', **loss)))


def _compare(head, samples, seed=0):
    lean = copy.deepcopy(head)
    assert make_lean(lean) == 'loss'
    logits0 = torch.randn(len(samples), CLASSES, 5, 6,
                          generator=torch.Generator().manual_seed(seed))
    assert_same_loss_by_feat(head, lean, logits0, samples)
    return lean, logits0


CASES = {
    # threshold binding: few pixels must be kept
    'thresh': (dict(type='OHEMPixelSampler', thresh=0.7, min_kept=5), {},
               True),
    # min_kept binding: the k-th smallest probability sets the threshold
    'min_kept': (dict(type='OHEMPixelSampler', thresh=0.05, min_kept=200),
                 dict(avg_non_ignore=True), True),
    # more to keep than labelled pixels
    'min_kept_all': (dict(type='OHEMPixelSampler', thresh=0.1,
                          min_kept=10**6), dict(loss_weight=0.4), True),
    # mmseg's class weights fail on ignored pixels: none here
    'class_weight': (dict(type='OHEMPixelSampler', thresh=0.6, min_kept=50),
                     dict(class_weight=[0.5, 1.0, 2.0, 1.5]), False),
    'sum': (dict(type='OHEMPixelSampler', thresh=0.7, min_kept=20),
            dict(reduction='sum'), True),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_sampled_loss_equals_mmseg(case):
    sampler, loss, ignored = CASES[case]
    head = _head(sampler, **loss)
    assert ohem_sampler_spec(head) is not None
    assert chunkable_losses(head) is not None
    samples = random_samples(3, CLASSES, (20, 24), seed=1,
                             ignored_rows=6 if ignored else 0)
    lean, logits0 = _compare(head, samples)
    # only the gradient (the logits' size) is kept for the backward
    logits = logits0.clone().requires_grad_(True)
    assert saved_tensor_bytes(
        lambda: lean.loss_by_feat(logits * 1.0, samples)) == \
        logits0.numel() * 4


def test_nothing_labelled():
    head = _head(dict(type='OHEMPixelSampler', thresh=0.7, min_kept=5),
                 avg_non_ignore=True)
    samples = random_samples(2, CLASSES, (10, 12), seed=2)
    for s in samples:
        s.gt_sem_seg.data[:] = 255
    _compare(head, samples)


def test_sampler_without_threshold_takes_the_head_loss():
    """Keeping the largest losses is not mirrored (their order depends on
    rounding): the head's own loss_by_feat runs, with the same numbers."""
    head = _head(dict(type='OHEMPixelSampler', min_kept=100))
    assert ohem_sampler_spec(head) is None
    assert chunkable_losses(head) is None
    _compare(head, random_samples(2, CLASSES, (20, 24), seed=3,
                                  ignored_rows=6))


def test_sampler_with_sigmoid_takes_the_head_loss():
    head = _head(dict(type='OHEMPixelSampler', thresh=0.7, min_kept=5),
                 use_sigmoid=True)
    assert chunkable_losses(head) is None
    _compare(head, random_samples(2, CLASSES, (20, 24), seed=4,
                                  ignored_rows=6))
