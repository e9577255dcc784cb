"""Layer selection: last-N in execution order, explicit paths, radius rules.

Expected paths were derived by reading the heads' ``forward`` code:
PSPHead runs ``psp_modules`` (pool scales 1, 2, 3, 6) then ``bottleneck``;
ASPPHead runs ``image_pool``, ``aspp_modules`` (4 dilations), ``bottleneck``;
FCNHead runs ``convs`` then ``conv_cat`` (concat_input); UPerHead runs the
``lateral_convs``, then the PPM (``psp_modules``, ``bottleneck``) on the last
level, then ``fpn_convs`` and ``fpn_bottleneck`` (registration order differs:
PPM first). ResNet BasicBlock runs conv1, conv2, then downsample;
MobileNetV2's InvertedResidual runs ``conv.0`` (expand), ``conv.1``
(depthwise), ``conv.2`` (project).
"""
import pytest
import torch
from torch import nn

from mmseg_gf.engine import (auto_radius, resolve_radius, select_layers,
                             trace_layers)
from tests.helpers.engine_fixtures import EXPECTED, PSP, build_model

_MODELS = {}


def get_model(name):
    if name not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name] = build_model(name)
    return _MODELS[name]


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_last_n_paths(name):
    model = get_model(name)
    records = trace_layers(model, (64, 64))
    for n, expected in EXPECTED[name].items():
        choices = select_layers(model, num_layers=n, radius=2,
                                input_size=(64, 64), records=records)
        assert [c.path for c in choices] == expected, (name, n)
        assert all(c.radius == 2 for c in choices)
        assert all(c.module is model.get_submodule(c.path) for c in choices)


def test_trace_restores_modes_and_has_shapes():
    model = get_model('pspnet_r18')
    model.train()
    model.decode_head.eval()
    bn = model.backbone.stem[1]
    stats = bn.running_mean.clone()
    records = trace_layers(model, (64, 64))
    assert model.training and not model.decode_head.training
    assert model.backbone.training
    assert torch.equal(bn.running_mean, stats)
    model.train()
    by_path = {r.path: r for r in records}
    rec = by_path['decode_head.bottleneck.conv']
    assert rec.in_shape == (1024, 8, 8) and rec.out_shape == (128, 8, 8)
    assert rec.norm_path == 'decode_head.bottleneck.bn'
    assert by_path['backbone.stem.0'].out_shape == (32, 32, 32)
    assert by_path['backbone.layer4.0.downsample.0'].norm_path == \
        'backbone.layer4.0.downsample.1'
    # classifier recorded but never counted among the last N
    assert records[-1].path == 'decode_head.conv_seg'


def test_layer_choice_geometry():
    model = get_model('deeplabv3_r18')
    (c, ) = select_layers(model, layers=['decode_head.aspp_modules.3.conv'],
                          radius=4, input_size=(64, 64))
    g = c.geometry
    assert g.kernel_size == (3, 3) and g.dilation == (36, 36)
    assert g.stride == (1, 1) and g.groups == 1
    assert c.in_shape == (512, 8, 8) and c.out_shape == (128, 8, 8)
    assert c.output_stride == 8


def test_explicit_paths_and_containers():
    model = get_model('pspnet_r18')
    choices = select_layers(
        model, layers=['decode_head.bottleneck.conv', 'backbone.layer4.1'],
        radius=4, input_size=(64, 64))
    # execution order, not the order given
    assert [c.path for c in choices] == [
        'backbone.layer4.1.conv1', 'backbone.layer4.1.conv2',
        'decode_head.bottleneck.conv'
    ]
    # a container skips the classifier (always trained, never filtered)
    head = select_layers(model, layers=['decode_head'], radius=4,
                         input_size=(64, 64))
    assert [c.path for c in head] == PSP


def test_depthwise_selected():
    model = get_model('pspnet_mv2')
    (c, ) = select_layers(model, layers=['backbone.layer7.0.conv.1.conv'],
                          radius=4, input_size=(64, 64))
    assert c.geometry.groups == 960 and c.geometry.dilation == (4, 4)


def test_auto_and_dict_radius():
    assert [auto_radius(s) for s in (1, 2, 4, 8, 16, 32)] == [8, 8, 8, 4, 2, 2]
    model = get_model('upernet_r18')
    choices = select_layers(model, num_layers=10, radius='auto',
                            input_size=(64, 64))
    radii = {c.path: c.radius for c in choices}
    assert radii['decode_head.fpn_convs.0.conv'] == 8  # 1/4
    assert radii['decode_head.fpn_convs.1.conv'] == 4  # 1/8
    assert radii['decode_head.fpn_convs.2.conv'] == 2  # 1/16
    assert radii['decode_head.bottleneck.conv'] == 2  # 1/32
    assert radii['decode_head.psp_modules.3.1.conv'] == 2
    # d8 nets: everything after layer2 is at 1/8
    psp = select_layers(get_model('pspnet_r18'), num_layers=10,
                        radius='auto', input_size=(64, 64))
    assert {c.radius for c in psp if 'psp_modules' not in c.path} == {4}
    radius = {'*': 2, 'decode_head': 4, 'decode_head.fpn_convs': 'auto',
              'decode_head.fpn_convs.2': 7}
    choices = select_layers(model, num_layers=5, radius=radius,
                            input_size=(64, 64))
    assert [c.radius for c in choices] == [4, 8, 4, 7, 4]
    assert resolve_radius({'backbone.layer4': 3, '*': 1},
                          'backbone.layer40.conv', 8) == 1


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_layers=0), r'num_layers must be an int in \[1, 27\]'),
    (dict(num_layers=28), r'runs 27 convs'),
    (dict(num_layers=2.5), 'num_layers'),
    (dict(layers=['decode_head.botleneck']),
     "no module 'decode_head.botleneck'.*did you mean.*"
     'decode_head.bottleneck'),
    (dict(layers=['decode_head.dropout']), 'contains no layer of'),
    (dict(layers=[]), 'non-empty list'),
    (dict(num_layers=2, layers=['decode_head']), 'exactly one of'),
    (dict(), 'exactly one of'),
    (dict(num_layers=2, radius=0), 'radius must be an int >= 1'),
    (dict(num_layers=2, radius='big'), "radius must be an int >= 1, 'auto'"),
    (dict(num_layers=2, radius={'backbone': 2}), 'no key of'),
    # a typo is an error whatever else the dict holds
    (dict(num_layers=2, radius={'*': 2, 'decode_head.bottlenek': 8}),
     "radius: no module 'decode_head.bottlenek'.*did you mean.*"
     "decode_head.bottleneck.*allowed keys: '\\*'"),
    (dict(layers=['decode_head'], radius={'decode_head': 2, 'backbon': 8}),
     "radius: no module 'backbon'.*did you mean.*'backbone'"),
    # the classifier is trained exactly by every setting, never filtered
    (dict(layers=['decode_head.conv_seg']),
     "'decode_head.conv_seg' is a decode head's classifier.*"
     'CalibrationHook'),
    (dict(layers=['decode_head.bottleneck', 'decode_head.conv_seg']),
     'classifier'),
])
def test_bad_selection(kwargs, match):
    model = get_model('pspnet_r18')
    with pytest.raises(ValueError, match=match):
        select_layers(model, input_size=(64, 64), **kwargs)


def test_unfilterable_and_convless():
    from mmcv.cnn.bricks.conv_ws import ConvWS2d
    model = get_model('fcn_r18')
    conv = model.decode_head.conv_cat.conv
    ws = ConvWS2d(conv.in_channels, conv.out_channels, 3, padding=1)
    model.decode_head.conv_cat.conv = ws
    try:
        with pytest.raises(ValueError, match='ConvWS2d.*cannot be gradient'):
            select_layers(model, num_layers=1, input_size=(64, 64))
    finally:
        model.decode_head.conv_cat.conv = conv

    class NoConv(nn.Module):

        def extract_feat(self, x):
            return [x]

        decode_head = nn.Identity()

    with pytest.raises(ValueError, match='ran no nn.Conv2d'):
        select_layers(NoConv(), num_layers=1, input_size=(8, 8))
    with pytest.raises(ValueError, match='extract_feat and decode_head'):
        select_layers(nn.Conv2d(3, 3, 1), num_layers=1)


def test_auxiliary_head_not_counted_but_nameable():
    from mmengine.config import ConfigDict
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    from tests.helpers.engine_fixtures import NORM, model_cfg
    init_default_scope('mmseg')
    cfg = model_cfg('pspnet_r18')
    cfg['auxiliary_head'] = dict(
        type='FCNHead', in_channels=256, in_index=2, channels=64,
        num_convs=1, concat_input=False, num_classes=3, norm_cfg=NORM,
        loss_decode=dict(type='CrossEntropyLoss', loss_weight=0.4))
    model = MODELS.build(ConfigDict(cfg))
    choices = select_layers(model, num_layers=5, input_size=(64, 64))
    assert [c.path for c in choices] == EXPECTED['pspnet_r18'][5]
    aux = select_layers(model, layers=['auxiliary_head'], input_size=(64, 64))
    assert [c.path for c in aux] == ['auxiliary_head.convs.0.conv']
