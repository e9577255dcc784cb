"""A frozen auxiliary head on trained features, after a class-count change,
does not steer the backbone: Swin UPerNet (its FCN head on ``stages.2``)
and PSPNet-R18 (an FCN head on ``layer3``), on the ``num_layers``,
``layers`` and ``budget`` paths.

The segmentor is built for 3 classes and loaded from a 5-class one, as a
transfer loads a checkpoint: every weight but the classifiers, whose shapes
differ (those stay random). Each setting trains a layer before the
auxiliary head's input, so the head reads trained features; its loss would
reach them through a classifier that is never trained. The check: the head
is not run, the trained gradients are those of the decode head's loss
alone (the same model with every head run, ``keep_frozen_aux_heads=True``,
its auxiliary loss left out of the backward), the one log line says the
head is cut off, and with the head run (mmseg's way) the gradients differ.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.config import ConfigDict  # noqa: E402
from mmengine.runner.checkpoint import load_state_dict  # noqa: E402

from mmseg_gf.accounting.batch import random_batch  # noqa: E402
from mmseg_gf.engine.config import build_grad_filter_model  # noqa: E402
from mmseg_gf.models.segmentor import set_frozen_norms_eval  # noqa: E402
from tests.helpers.engine_fixtures import NORM, model_cfg  # noqa: E402
from tests.test_engine.test_lean_transformer_families import \
    tiny_cfg  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')

SIZE = (64, 64)
SOURCE_CLASSES = 5


def _psp(num_classes):
    cfg = model_cfg('pspnet_r18')
    cfg['decode_head']['num_classes'] = num_classes
    cfg['auxiliary_head'] = dict(
        type='FCNHead', in_channels=256, in_index=2, channels=16,
        num_convs=1, concat_input=False, dropout_ratio=0.1,
        num_classes=num_classes, norm_cfg=NORM, align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', loss_weight=0.4))
    return ConfigDict(cfg)


def _swin(num_classes):
    model = tiny_cfg('swin_t').model
    model.decode_head.num_classes = num_classes
    model.auxiliary_head.num_classes = num_classes
    assert model.auxiliary_head.in_index == 2
    return model


#: model -> settings of the three paths, each training a layer before the
#: auxiliary head's input (PSPNet: ``layer3.1``; Swin: ``stages.2``'s
#: last block; the budget's large limit takes the whole pool)
PATHS = {
    'pspnet_r18': (_psp, {
        'num_layers': dict(num_layers=12, radius=4),
        'layers': dict(layers=['backbone.layer3.1.conv2',
                               'decode_head.bottleneck.conv'], radius=4),
        'budget': dict(budget=dict(saved_mib=1000, radii=[4])),
    }),
    'swin_t': (_swin, {
        'num_layers': dict(num_layers=24, radius=4),
        'layers': dict(layers=['backbone.stages.2.blocks.1.ffn.layers.1',
                               'decode_head.fpn_bottleneck.conv'],
                       radius=4),
        'budget': dict(budget=dict(saved_mib=1000, radii=[4])),
    }),
}


def _transferred(make, settings, **flags):
    """The 3-class gradient-filtered model, loaded from a 5-class one."""
    from mmengine.registry import init_default_scope
    init_default_scope('mmseg')
    torch.manual_seed(0)
    source = build_grad_filter_model(make(SOURCE_CLASSES), num_layers=1,
                                     radius=4, input_size=SIZE)
    torch.manual_seed(1)
    model = build_grad_filter_model(make(3), input_size=SIZE, **settings,
                                    **flags)
    load_state_dict(model, source.state_dict(), strict=False)
    return model


def _grads(model, batch, with_aux=True):
    model.zero_grad(set_to_none=True)
    model.train()
    set_frozen_norms_eval(model)
    torch.manual_seed(3)
    losses = model.loss(*batch)
    sum(v for k, v in losses.items() if 'loss' in k and (
        with_aux or not k.startswith('aux'))).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.requires_grad}
    return losses, grads


@pytest.mark.parametrize('path', ['num_layers', 'layers', 'budget'])
@pytest.mark.parametrize('name', list(PATHS))
def test_frozen_aux_head_is_cut_off_after_a_class_count_change(
        name, path, log_records):
    make, paths = PATHS[name]
    settings = paths[path]
    model = _transferred(make, settings)
    mmseg_way = _transferred(make, settings, keep_frozen_aux_heads=True)
    batch = random_batch(model, SIZE, 2, label_block=4)
    calls = []
    model.auxiliary_head.conv_seg.register_forward_hook(
        lambda *args: calls.append(1))
    losses, got = _grads(model, batch)
    _, want = _grads(mmseg_way, batch, with_aux=False)
    _, steered = _grads(mmseg_way, batch)
    assert not calls
    assert not any(k.startswith('aux') for k in losses)
    assert got.keys() == want.keys()
    for key, g in want.items():
        torch.testing.assert_close(got[key], g, rtol=1e-5, atol=1e-7,
                                   msg=key)
    # mmseg's way: the random classifier's loss reaches the backbone
    backbone = [k for k in want if k.startswith('backbone.')]
    assert backbone
    assert any(not torch.allclose(steered[k], want[k], rtol=1e-4,
                                  atol=1e-6) for k in backbone)
    logged = [m for m in log_records if 'auxiliary_head (FCNHead)' in m]
    assert len(logged) == 1, log_records
    assert 'cut off from the backbone' in logged[0]
    assert 'in_index 2' in logged[0]
