"""mmseg_gf.models.head_resizes: inside ``routed_resizes`` this thread's
bilinear resizes that need a gradient run as ``BilinearResizeFunction``
(autograd's numbers), everything else is torch's, and ``F.interpolate``
is torch's own again once the last thread leaves."""
import threading

import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.models.head_resizes import routed_resizes, routing
from mmseg_gf.ops.resize.bilinear import BilinearResizeFunction
from tests.test_ops.resize.test_resize import RESIZES, _head

TORCH_INTERPOLATE = F.interpolate
ROUTED = BilinearResizeFunction._backward_cls


@pytest.mark.parametrize('resize', RESIZES)
def test_same_outputs_and_gradients_as_autograd(resize, switch_override):
    switch_override(MMSEG_GF_NATIVE=False)  # torch's kernel: bit for bit
    gen = torch.Generator().manual_seed(0)
    x0, other0 = torch.randn(3, 4, 6, 5, generator=gen), \
        torch.randn(3, 2, 5, 5, generator=gen)
    results = []
    for routed in (False, True):
        x = x0.clone().requires_grad_(True)
        other = other0.clone().requires_grad_(True)
        if routed:
            with routed_resizes():
                loss, up = _head(x, other, **resize)
            assert isinstance(up.grad_fn, ROUTED)
        else:
            loss, up = _head(x, other, **resize)
            assert not isinstance(up.grad_fn, ROUTED)
        loss.backward()
        results.append((up.detach(), x.grad, other.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_keyword_calls_are_routed():
    """``F.interpolate`` called with keywords only (the other calls:
    tests/test_ops/resize/test_resize.py, both routings)."""
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    with routed_resizes():
        keywords = F.interpolate(input=x, size=(5, 7), mode='bilinear',
                                 align_corners=True)
    assert isinstance(keywords.grad_fn, ROUTED)
    assert keywords.shape == (1, 2, 5, 7)


def test_interpolate_is_torchs_again_after_nesting_and_errors():
    assert F.interpolate is TORCH_INTERPOLATE and not routing()
    with routed_resizes():
        assert F.interpolate is not TORCH_INTERPOLATE and routing()
        with routed_resizes():
            assert routing()
        assert routing() and F.interpolate is not TORCH_INTERPOLATE
    assert F.interpolate is TORCH_INTERPOLATE and not routing()
    with pytest.raises(ZeroDivisionError):
        with routed_resizes():
            1 / 0
    assert F.interpolate is TORCH_INTERPOLATE and not routing()


def test_another_thread_sees_torchs_resizes():
    """A thread outside the block gets torch's node while this one routes,
    and the entry stays set until the last thread leaves."""
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def other_thread():
        with routed_resizes():
            inside.set()
            leave.wait(10)

    def outside_thread():
        seen['grad_fn'] = F.interpolate(x, scale_factor=2,
                                        mode='bilinear').grad_fn

    worker = threading.Thread(target=other_thread)
    worker.start()
    assert inside.wait(10)
    try:
        with routed_resizes():
            pass
        # the worker is still inside: the entry stays
        assert F.interpolate is not TORCH_INTERPOLATE
        probe = threading.Thread(target=outside_thread)
        probe.start()
        probe.join(10)
        assert not isinstance(seen['grad_fn'], ROUTED)
        assert seen['grad_fn'] is not None
    finally:
        leave.set()
        worker.join(10)
    assert F.interpolate is TORCH_INTERPOLATE


def test_an_eager_lean_segformer_head_routes_its_resizes(monkeypatch):
    """A lean SegformerHead's loss resizes its four maps through the rule
    (no torch function mode), gives mmseg's head's losses and input
    gradients, and leaves ``F.interpolate`` torch's."""
    pytest.importorskip('mmseg')
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    from mmseg_gf.models import head_resizes
    from mmseg_gf.models.lean import is_lean, make_lean
    from tests.helpers.loss_checks import random_samples
    register_all_modules(init_default_scope=False)
    torch.manual_seed(0)
    plain = MODELS.build(dict(
        type='SegformerHead', in_channels=[4, 4, 4, 4], in_index=[0, 1, 2, 3],
        channels=8, num_classes=3, dropout_ratio=0.0, align_corners=False,
        norm_cfg=dict(type='BN'),
        loss_decode=dict(type='CrossEntropyLoss'))).train()
    lean = make_lean_copy(plain, make_lean)
    assert is_lean(lean)
    routed = []

    def counting(*args, **kwargs):
        out = rule(*args, **kwargs)
        routed.append(out is not None)
        return out

    rule = head_resizes.strided_gradient_resize
    monkeypatch.setattr(head_resizes, 'strided_gradient_resize', counting)
    samples = random_samples(2, 3, (16, 16), seed=0)
    gen = torch.Generator().manual_seed(1)
    maps = [torch.randn(2, 4, s, s, generator=gen) for s in (8, 4, 2, 2)]
    results = []
    for head in (plain, lean):
        inputs = [m.clone().requires_grad_(True) for m in maps]
        losses = head.loss(inputs, samples, None)
        losses['loss_ce'].backward()
        results.append((losses['loss_ce'].detach(),
                        [x.grad for x in inputs]))
        assert F.interpolate is TORCH_INTERPOLATE
    assert sum(routed) >= 3  # the three smaller maps at least
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5,
                               atol=1e-6)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def make_lean_copy(head, make_lean):
    """A deep copy of ``head`` with every submodule made lean."""
    import copy
    lean = copy.deepcopy(head)
    for module in lean.modules():
        make_lean(module)
    return lean
