"""The lean trained region on the six protocol models: the same forward,
loss and gradients as ``lean=False``, and measured saved bytes equal to the
analytic count (:mod:`mmseg_gf.accounting.saved_bytes`)."""
import copy

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

pytest.importorskip('mmseg')

from tests.helpers.engine_fixtures import (  # noqa: E402
    SIX_MODELS, SMALL_BATCH, SMALL_SIZE, build_model, filtered_copy)
from tests.helpers.devices import DEVICE_PATHS, on_path  # noqa: E402
from tests.helpers.lean_steps import training_step  # noqa: E402
from tests.helpers.loss_checks import assert_same_loss_by_feat  # noqa: E402

from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from mmseg_gf.accounting.batch import (random_batch,  # noqa: E402
                                       summed_losses, training_loss)
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.engine.lean_region import (lean_counts,  # noqa: E402
                                         remove_lean_region)
from mmseg_gf.models.lean_head import (  # noqa: E402
    disable_classifier_fusion)

MODELS, SIZE, BATCH = SIX_MODELS, SMALL_SIZE, SMALL_BATCH


def _calibrated(name):
    """A model whose BN layers hold non-trivial running statistics."""
    torch.manual_seed(0)
    model = build_model(name)
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
            m.running_var.copy_(
                torch.rand(m.num_features, generator=gen) + 0.5)
    return model


def _prepared(base, num_layers, mode, lean, device='cpu'):
    return filtered_copy(base, num_layers, 4, SIZE, mode=mode,
                         lean=lean).to(device)


def _logits_and_step(model, inputs, samples):
    """The logits of a seeded forward (a lean forward equals the plain one
    exactly on CPU), then :func:`training_step`'s summed loss and
    gradients: ``(logits, loss, grads)``."""
    torch.manual_seed(5)  # the decode head's dropout draws the same noise
    logits = model._forward(inputs)
    losses, grads = training_step(model, inputs, samples)
    return logits.detach(), summed_losses(losses).detach(), grads


@pytest.mark.parametrize('name', MODELS)
def test_lean_step_equals_plain_step(name):
    _check_lean_step(name, (5, 10))


@pytest.mark.parametrize('device_path', DEVICE_PATHS[1:])
def test_lean_step_equals_plain_step_kernels_off_and_on_cuda(device_path):
    """A protocol model's lean step on the path CUDA tensors take (the
    compiled CPU kernels off) and on CUDA itself."""
    with on_path(device_path) as device:
        _check_lean_step('pspnet_r18', (5, ), device)


def _check_lean_step(name, layer_counts, device='cpu'):
    """Lean and ``lean=False`` steps of the last N convs of ``name`` on
    ``device``: the same logits, loss and gradients."""
    base = _calibrated(name)
    inputs, samples = random_batch(base, SIZE, BATCH, device=device,
                                   label_block=4)
    for i in range(2):  # an ignored band, so ignore_index is exercised
        samples[i].gt_sem_seg.data[:, :4] = 255
    for num_layers in layer_counts:
        for mode in ('gf', 'vanilla'):
            plain = _prepared(base, num_layers, mode, False, device)
            lean = _prepared(base, num_layers, mode, True, device)
            counts = lean_counts(lean)
            assert counts['norm'] > 0 and counts['activation'] > 0
            assert counts['loss'] == 1 and not lean_counts(plain)
            want = _logits_and_step(plain, inputs, samples)
            got = _logits_and_step(lean, inputs, samples)
            assert got[0].device.type == device
            if device == 'cpu':
                assert torch.equal(want[0], got[0]), 'forward differs'
            else:  # cuDNN may pick another algorithm for another layout
                torch.testing.assert_close(got[0], want[0], rtol=1e-6,
                                           atol=1e-6)
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
            assert want[2].keys() == got[2].keys()
            for key, g in want[2].items():
                torch.testing.assert_close(
                    got[2][key], g, rtol=1e-5,
                    atol=1e-6 * float(g.abs().max()),
                    msg=lambda m: f'{name} N={num_layers} {mode} {key}: {m}')


@pytest.mark.parametrize('name', MODELS)
def test_measured_saved_bytes_equal_analytic_count(name):
    base = _calibrated(name)
    inputs, samples = random_batch(base, SIZE, BATCH, label_block=4)
    for num_layers in (5, 10):
        for mode in ('gf', 'vanilla'):
            lean = _prepared(base, num_layers, mode, lean=True)
            plain = _prepared(base, num_layers, mode, lean=False)

            def kept(model):
                return saved_tensor_bytes(
                    lambda: training_loss(model, inputs, samples))

            measured = kept(lean)
            counted = trace_step_saved_bytes(lean, SIZE)
            assert not counted.unmodelled, counted.unmodelled
            assert counted.total(BATCH) == measured, (
                name, num_layers, mode, counted.by_category(BATCH))
            assert measured < kept(plain)


def test_remove_lean_region_restores_plain_classes():
    model = _prepared(_calibrated('pspnet_r18'), 5, 'gf', lean=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert remove_lean_region(model) > 0
    assert not lean_counts(model)
    assert all(torch.equal(v, before[k])
               for k, v in model.state_dict().items())


LOSS_CASES = {
    'ce': [dict(type='CrossEntropyLoss', loss_weight=1.0)],
    'ce_non_ignore_weighted': [
        dict(type='CrossEntropyLoss', loss_weight=0.4, avg_non_ignore=True)
    ],
    'two_ce_one_name': [
        dict(type='CrossEntropyLoss', loss_weight=1.0),
        dict(type='CrossEntropyLoss', loss_weight=0.5, avg_non_ignore=True)
    ],
    'ce_sum_and_mean': [
        dict(type='CrossEntropyLoss', loss_name='loss_a', reduction='sum'),
        dict(type='CrossEntropyLoss', loss_name='loss_b')
    ],
    'sigmoid_two_ways': [  # binary cross-entropy on one-hot labels
        dict(type='CrossEntropyLoss', use_sigmoid=True, loss_name='loss_a'),
        dict(type='CrossEntropyLoss', use_sigmoid=True, loss_name='loss_b',
             loss_weight=0.4, avg_non_ignore=True)
    ],
    'class_weight': [
        dict(type='CrossEntropyLoss', class_weight=[0.5, 1.0, 2.0])
    ],
    'class_weights_two': [  # two gradient bases, one per class weighting
        dict(type='CrossEntropyLoss', class_weight=[0.5, 1.0, 2.0],
             avg_non_ignore=True, loss_name='loss_a'),
        dict(type='CrossEntropyLoss', loss_weight=0.3, loss_name='loss_a'),
        dict(type='CrossEntropyLoss', class_weight=[0.5, 1.0, 2.0],
             reduction='sum', loss_name='loss_b'),
    ],
    # not chunked: the head's loss_by_feat on the whole batch
    'dice': [dict(type='DiceLoss', loss_weight=0.7)],
}


@pytest.mark.parametrize('case', sorted(LOSS_CASES))
def test_lean_loss_equals_mmseg_loss_by_feat(case):
    from mmseg.registry import MODELS as SEG_MODELS

    from mmseg_gf.models.lean import make_lean
    from mmseg_gf.models.lean_loss import chunkable_losses
    head = SEG_MODELS.build(
        dict(type='FCNHead', in_channels=4, channels=4, num_convs=1,
             num_classes=3, align_corners=False,
             loss_decode=LOSS_CASES[case]))
    lean = copy.deepcopy(head)
    assert make_lean(lean) == 'loss'
    chunked = chunkable_losses(lean) is not None
    assert chunked == (case != 'dice')
    model = build_model('fcn_r18')
    _, samples = random_batch(model, (20, 24), 3, label_block=3)
    if 'class_weight' not in case:  # mmseg's fail on ignored pixels
        samples[0].gt_sem_seg.data[:, :5] = 255
        samples[2].gt_sem_seg.data[:] = 255  # an image with no label
    logits0 = torch.randn(3, 3, 5, 6, generator=torch.Generator()
                          .manual_seed(2))
    assert_same_loss_by_feat(head, lean, logits0, samples)
    logits = logits0.clone().requires_grad_(True)
    bases = 2 if case == 'class_weights_two' else 1
    assert saved_tensor_bytes(
        lambda: lean.loss_by_feat(logits * 1.0, samples)) == \
        bases * logits0.numel() * 4


@pytest.mark.parametrize('name', ['fcn_r18', 'upernet_r18'])
def test_fused_classifier_keeps_less_and_is_counted(name):
    """The classifier fused with its loss keeps g_z, g_W, g_b instead of its
    input and the logits: measured equal to the analytic count, and below
    the unfused lean step (the head's fusion switched off by hand)."""
    base = _calibrated(name)
    inputs, samples = random_batch(base, SIZE, BATCH, label_block=4)
    fused = _prepared(base, 5, 'gf', lean=True)
    unfused = _prepared(base, 5, 'gf', lean=True)
    disable_classifier_fusion(unfused.decode_head, 'switched off by the test')
    kept = {}
    for key, model in (('fused', fused), ('unfused', unfused)):
        kept[key] = saved_tensor_bytes(
            lambda: training_loss(model, inputs, samples))
        counted = trace_step_saved_bytes(model, SIZE)
        assert counted.total(BATCH) == kept[key], (key, counted.by_category(
            BATCH))
    conv = fused.decode_head.conv_seg
    seen = []
    handle = conv.register_forward_hook(
        lambda m, args, out: seen.append(args[0].nbytes))
    training_loss(fused, inputs, samples)
    handle.remove()
    x_bytes, grads = seen[0], 4 * (conv.weight.numel() + conv.bias.numel())
    assert kept['unfused'] - kept['fused'] == x_bytes - grads
    want = _logits_and_step(_prepared(base, 5, 'gf', lean=False), inputs,
                            samples)
    got = _logits_and_step(fused, inputs, samples)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
    for key, g in want[2].items():
        torch.testing.assert_close(got[2][key], g, rtol=1e-5,
                                   atol=1e-6 * float(g.abs().max()))


def test_class_weights_with_ignored_pixels():
    """mmseg 1.2.2's CrossEntropyLoss with class weights and a mean raises
    an IndexError on an ignored pixel; the lean loss weighs them 0: PyTorch's
    class-weighted mean cross-entropy of the upsampled logits."""
    import torch.nn.functional as F
    from mmseg.registry import MODELS as SEG_MODELS

    from mmseg_gf.models.lean import make_lean
    weights = [0.5, 1.0, 2.0]
    head = SEG_MODELS.build(
        dict(type='FCNHead', in_channels=4, channels=4, num_convs=1,
             num_classes=3, align_corners=False,
             loss_decode=dict(type='CrossEntropyLoss', loss_weight=0.7,
                              class_weight=weights)))
    lean = copy.deepcopy(head)
    make_lean(lean)
    _, samples = random_batch(build_model('fcn_r18'), (20, 24), 2,
                              label_block=3)
    samples[0].gt_sem_seg.data[:, :5] = 255
    logits = torch.randn(2, 3, 5, 6, generator=torch.Generator()
                         .manual_seed(3))
    with pytest.raises(IndexError):
        head.loss_by_feat(logits, samples)
    label = torch.cat([s.gt_sem_seg.data for s in samples])
    up = F.interpolate(logits, size=label.shape[-2:], mode='bilinear',
                       align_corners=False)
    want = 0.7 * F.cross_entropy(up, label, weight=torch.tensor(weights),
                                 ignore_index=255)
    leaf = logits.clone().requires_grad_(True)
    got = lean.loss_by_feat(leaf * 1.0, samples)['loss_ce']
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
