"""Memory of the lean loss on a PIDNet-like head: nothing of the loss's
in-forward graph outlives the step, and the step's peak of live tensor
bytes is not above the plain head's (docs/lean_region.md, "The loss, fused
with the classifier").

Live bytes come from torch's CPU profiler with the garbage collector off
(:func:`~mmseg_gf.accounting.measured.live_bytes_by_interval`), as in the
step benchmark: a reference cycle would show as bytes still alive.
"""
import copy

import pytest
import torch

pytest.importorskip('mmseg')

from mmseg.utils import register_all_modules  # noqa: E402
from tests.helpers.loss_checks import pid_head, random_samples  # noqa: E402

from mmseg_gf.accounting.measured import (live_bytes_by_interval,  # noqa: E402
                                          mark)
from mmseg_gf.models.lean import make_lean  # noqa: E402

register_all_modules(init_default_scope=False)

K = 5  # classes
LOW, HIGH = (16, 16), (128, 128)  # logits' and labels' sizes (x 8)


def _freeze_side_branches(head):
    """As GF's last layers train it: the P and D branches frozen."""
    for module in (head.p_head, head.p_cls_seg, head.d_head, head.d_cls_seg):
        module.requires_grad_(False)


def _step_live_bytes(head, trained_inputs):
    """``(peak, left)``: the step's peak of live bytes, and what is still
    alive after its backward with the loss outputs dropped (the gradients
    of the inputs and parameters, nothing of the loss)."""
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn((2, c) + LOW, generator=gen).requires_grad_(t)
              for c, t in zip((4, 8, 4), trained_inputs)]
    samples = random_samples(2, K, HIGH, seed=2, edges=True)
    head.train()

    def step():
        losses = head.loss(inputs, samples, None)
        sum(v for k, v in losses.items() if 'loss' in k).backward()
        del losses
        mark()

    peaks = live_bytes_by_interval(step)
    for x in inputs:
        x.grad = None
    head.zero_grad(set_to_none=True)
    return max(peaks), peaks[-1]


@pytest.mark.parametrize('frozen_sides', [False, True])
def test_lean_step_frees_its_loss_and_peaks_no_higher(frozen_sides):
    plain = pid_head(K, min_kept=2000)
    if frozen_sides:
        _freeze_side_branches(plain)
    lean = copy.deepcopy(plain)
    assert make_lean(lean) == 'loss'
    trained = (not frozen_sides, True, not frozen_sides)
    _step_live_bytes(lean, trained)  # first call: logging, lazy state
    want_peak, want_left = _step_live_bytes(plain, trained)
    got_peak, got_left = _step_live_bytes(lean, trained)
    assert got_left <= want_left
    # The lean step holds the loss's gradient w.r.t. the classifier's
    # logits from the forward on; the plain one makes it in its backward.
    # At this size that can be the difference at the peak (measured:
    # 5 KB of 6 MB, torch 2.13 CPU).
    logits_bytes = 2 * K * LOW[0] * LOW[1] * 4
    assert got_peak <= want_peak + logits_bytes
