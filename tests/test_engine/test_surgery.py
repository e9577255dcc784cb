"""Surgery: swap to GFConv2d sharing Parameters, freeze, keep norms in eval.

Every test goes through real mmseg segmentors (tiny inputs, plain BN, no
auxiliary head, batch 2 so the PSP / ASPP pooling branches can train).
"""
import logging

import pytest
import torch

from mmseg_gf.engine import (apply_gradient_filter, get_gradient_filter_layers,
                             select_layers, set_frozen_norms_eval)
from mmseg_gf.models import GFConv2d
from mmseg_gf.ops import gradient_filtered_conv2d
from tests.helpers.engine_fixtures import EXPECTED, build_model

INPUT = (64, 64)


def _prepared(name, n, mode='gf', train_norm=False, radius=2):
    torch.manual_seed(0)
    model = build_model(name)
    choices = select_layers(model, num_layers=n, radius=radius,
                            input_size=INPUT)
    apply_gradient_filter(model, choices, mode=mode, train_norm=train_norm)
    return model, choices


def _loss_backward(model, seed=1):
    model.train()
    set_frozen_norms_eval(model)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, *INPUT, generator=g)
    torch.manual_seed(seed)  # same dropout mask for every model
    out = model(x, None, mode='tensor')
    (out.square().mean() + out.mean()).backward()
    return out


def _grad_owners(model):
    return {
        name.rsplit('.', 1)[0]
        for name, p in model.named_parameters()
        if p.grad is not None and p.grad.abs().sum() > 0
    }


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_only_selected_layers_get_gradients(name):
    for n in (1, 5, 10):
        model, choices = _prepared(name, n)
        for c in choices:
            assert isinstance(model.get_submodule(c.path), GFConv2d)
            assert model.get_submodule(c.path).radius == 2
        _loss_backward(model)
        expected = set(EXPECTED[name][n]) | {'decode_head.conv_seg'}
        assert _grad_owners(model) == expected, (name, n)
        trainable = {
            name.rsplit('.', 1)[0]
            for name, p in model.named_parameters() if p.requires_grad
        }
        assert trainable == expected


@pytest.mark.parametrize('name', ['upernet_r18', 'deeplabv3_mv2'])
def test_state_dict_and_parameters_unchanged(name):
    torch.manual_seed(0)
    model = build_model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    choices = select_layers(model, num_layers=10, radius=2, input_size=INPUT)
    apply_gradient_filter(model, choices)
    after = model.state_dict()
    assert list(after) == list(before)  # same keys, same order
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # the very same Parameter objects: an optimizer built before stays valid
    assert all(p is params[k] for k, p in model.named_parameters())
    assert set(build_model(name).state_dict()) == set(after)


def test_frozen_norms_eval_and_train_norm():
    model, choices = _prepared('fcn_r18', 5)
    model.train()
    n_eval = set_frozen_norms_eval(model)
    bns = [m for m in model.modules()
           if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert n_eval == len(bns) and not any(m.training for m in bns)
    stats = {k: v.clone() for k, v in model.state_dict().items()
             if 'running' in k}
    _loss_backward(model)
    assert all(torch.equal(v, model.state_dict()[k])
               for k, v in stats.items())

    model, choices = _prepared('fcn_r18', 5, train_norm=True)
    _loss_backward(model)
    norms = {c.norm_path for c in choices}
    assert norms == {'backbone.layer4.1.bn1', 'backbone.layer4.1.bn2',
                     'decode_head.convs.0.bn', 'decode_head.convs.1.bn',
                     'decode_head.conv_cat.bn'}
    owners = _grad_owners(model)
    assert norms <= owners
    assert model.decode_head.conv_cat.bn.training
    assert not model.backbone.layer4[0].bn1.training


def test_vanilla_mode_is_exact_and_gf_differs():
    """'vanilla' = same layers, exact backward; the classifier (after every
    filtered layer) gets the exact gradient in both modes."""
    vanilla, _ = _prepared('pspnet_r18', 5, mode='vanilla')
    gf, choices = _prepared('pspnet_r18', 5, mode='gf')
    assert all(not vanilla.get_submodule(c.path).enabled for c in choices)
    assert all(gf.get_submodule(c.path).enabled for c in choices)
    torch.manual_seed(0)
    plain = build_model('pspnet_r18')
    trained = {n for n, q in vanilla.named_parameters() if q.requires_grad}
    for p_name, p in plain.named_parameters():
        p.requires_grad_(p_name in trained)
    outs = [_loss_backward(m) for m in (vanilla, gf, plain)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    pv = dict(vanilla.named_parameters())
    pg = dict(gf.named_parameters())
    pp = dict(plain.named_parameters())
    for key in ('decode_head.conv_seg.weight', 'decode_head.conv_seg.bias'):
        torch.testing.assert_close(pg[key].grad, pv[key].grad)
    w = 'decode_head.bottleneck.conv.weight'
    torch.testing.assert_close(pv[w].grad, pp[w].grad)
    assert not torch.allclose(pg[w].grad, pv[w].grad)


def test_reapplication_is_idempotent():
    model, choices = _prepared('pspnet_r18', 5)
    again = select_layers(model, num_layers=10, radius=8, input_size=INPUT)
    applied = apply_gradient_filter(model, again)
    assert [c.path for c in applied] == [c.path for c in choices]
    assert get_gradient_filter_layers(model) is not None
    assert model.decode_head.bottleneck.conv.radius == 2
    assert not isinstance(model.backbone.layer4[0].conv1, GFConv2d)


def test_bad_mode():
    model = build_model('fcn_r18')
    choices = select_layers(model, num_layers=1, input_size=INPUT)
    with pytest.raises(ValueError, match=r"mode must be one of \('gf', "):
        apply_gradient_filter(model, choices, mode='exact')


def test_efficient_conv_bn_eval_uses_filter():
    """mmcv's efficient conv-bn-eval path calls ``conv._conv_forward`` with a
    fused weight: GFConv2d filters it there."""
    from mmcv.cnn import ConvModule
    from mmengine.registry import init_default_scope

    # mmcv looks conv types up in the current default scope's registry
    init_default_scope('mmseg')
    torch.manual_seed(0)
    cm = ConvModule(4, 6, 3, padding=1,
                    conv_cfg=dict(type='GFConv2d', radius=2),
                    norm_cfg=dict(type='BN'), act_cfg=None,
                    efficient_conv_bn_eval=True)
    cm.bn.running_mean.normal_()
    cm.bn.running_var.uniform_(0.5, 2)
    cm.bn.weight.data.normal_()
    cm.bn.requires_grad_(False)
    cm.eval()
    assert cm.efficient_conv_bn_eval_forward is not None
    # spy: the efficient path hands _conv_forward a fused (non-Parameter)
    # weight; the usual path would pass the Parameter itself
    seen = []
    inner = cm.conv._conv_forward

    def spy(inp, weight, bias):
        seen.append(weight is cm.conv.weight)
        return inner(inp, weight, bias)

    cm.conv._conv_forward = spy
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    gy = torch.randn(2, 6, 8, 8)
    cm(x).backward(gy)
    assert seen == [False]
    gx, gw = x.grad.clone(), cm.conv.weight.grad.clone()
    # reference: the filtered conv with the fused weight / bias
    bn = cm.bn
    w0 = cm.conv.weight.detach().clone().requires_grad_(True)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    fused_w = w0 * scale.view(-1, 1, 1, 1)
    fused_b = bn.bias - bn.running_mean * scale
    if cm.conv.bias is not None:
        fused_b = fused_b + cm.conv.bias * scale
    x2 = x.detach().clone().requires_grad_(True)
    y = gradient_filtered_conv2d(x2, fused_w, fused_b, padding=1, radius=2)
    torch.testing.assert_close(cm(x), y)
    y.backward(gy)
    torch.testing.assert_close(gx, x2.grad)
    torch.testing.assert_close(gw, w0.grad)
    exact = torch.autograd.grad(
        torch.nn.functional.conv2d(x2, fused_w, fused_b, padding=1), x2, gy)
    assert not torch.allclose(exact[0], gx)


def test_a_radius_larger_than_a_map_is_a_warning_once_per_layer(
        monkeypatch):
    """At a 32x32 input, PSPNet's pyramid convs run on 1x1, 2x2, 3x3 and
    6x6 maps and the bottleneck on 4x4: r = 4 exceeds the first three,
    each named once; the vanilla mode, which filters nothing, says
    nothing."""
    from mmseg_gf.engine import surgery
    lines = []
    monkeypatch.setattr(surgery, 'print_log',
                        lambda msg, **kw: lines.append((msg, kw['level'])))
    for mode in ('vanilla', 'gf'):
        model = build_model('pspnet_r18')
        choices = select_layers(model, num_layers=5, radius=4,
                                input_size=(32, 32))
        apply_gradient_filter(model, choices, mode=mode)
        apply_gradient_filter(model, choices, mode=mode)  # idempotent
        if mode == 'vanilla':
            assert lines == []
    assert [line.split("'")[1] for line, _ in lines] == [
        f'decode_head.psp_modules.{i}.1.conv' for i in range(3)]
    assert all(level == logging.WARNING for _, level in lines)
    assert 'radius 4' in lines[0][0] and '1x1 output map' in lines[0][0]
    assert 'at the 32x32 input' in lines[0][0]
