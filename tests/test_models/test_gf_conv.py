"""GFConv2d: the registered nn.Conv2d subclass around the operator."""

import pytest
import torch
import torch.nn.functional as F
from mmcv.cnn import ConvModule, build_conv_layer
from mmengine.registry import init_default_scope
from torch import nn

from mmseg_gf import GFConv2d, gradient_filtered_conv2d


@pytest.fixture(autouse=True)
def mmseg_scope():
    init_default_scope('mmseg')


def _grads(module, x, grad_out):
    x = x.detach().requires_grad_()
    module.zero_grad()
    out = module(x)
    out.backward(grad_out)
    return out, x.grad, module.weight.grad.clone()


def test_forward_is_exact_and_backward_is_the_operator():
    torch.manual_seed(0)
    conv = GFConv2d(4, 6, 3, stride=2, padding=1, radius=2)
    x = torch.randn(2, 4, 15, 13)
    grad_out = torch.randn(2, 6, 8, 7)
    out, gx, gw = _grads(conv, x, grad_out)
    assert torch.equal(out, F.conv2d(x, conv.weight, conv.bias, 2, 1))

    xr = x.clone().requires_grad_()
    wr = conv.weight.detach().clone().requires_grad_()
    gradient_filtered_conv2d(xr, wr, conv.bias.detach(), 2, 1, 1, 1,
                             2).backward(grad_out)
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(gw, wr.grad)


def test_disabled_is_the_exact_backward():
    torch.manual_seed(0)
    conv = GFConv2d(3, 5, 3, padding=1, radius=4, enabled=False)
    plain = nn.Conv2d(3, 5, 3, padding=1)
    plain.load_state_dict(conv.state_dict())
    x, grad_out = torch.randn(2, 3, 9, 9), torch.randn(2, 5, 9, 9)
    _, gx, gw = _grads(conv, x, grad_out)
    _, px, pw = _grads(plain, x, grad_out)
    torch.testing.assert_close(gx, px)
    torch.testing.assert_close(gw, pw)


def test_from_conv_shares_parameters_and_state_dict():
    conv = nn.Conv2d(3, 5, 3, padding=2, dilation=2, bias=False)
    gf = GFConv2d.from_conv(conv, radius=3)
    assert gf.weight is conv.weight and gf.bias is None
    assert gf.dilation == (2, 2) and gf.padding == (2, 2)
    assert gf.state_dict().keys() == conv.state_dict().keys()
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(gf(x), conv(x))
    assert 'radius=3' in repr(gf)


def test_from_conv_refuses_convs_that_are_not_plain():

    class ScaledConv(nn.Conv2d):

        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(TypeError, match='cannot gradient-filter a .*Scaled'):
        GFConv2d.from_conv(ScaledConv(3, 3, 3), radius=2)


def test_built_from_conv_cfg_in_convmodule():
    layer = build_conv_layer(
        dict(type='GFConv2d', radius=4), 3, 8, 3, padding=1)
    assert isinstance(layer, GFConv2d) and layer.radius == 4
    block = ConvModule(
        3, 8, 3, padding=1, conv_cfg=dict(type='GFConv2d', radius=2),
        norm_cfg=dict(type='BN'))
    assert isinstance(block.conv, GFConv2d) and block.conv.radius == 2
    out = block(torch.randn(2, 3, 8, 8, requires_grad=True))
    out.sum().backward()
    assert block.conv.weight.grad is not None


def test_no_grad_runs_the_plain_convolution():
    conv = GFConv2d(3, 4, 3, padding=1, radius=2)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        out = conv(x)
    assert out.grad_fn is None
    assert torch.equal(out, F.conv2d(x, conv.weight, conv.bias, 1, 1))


def test_reflect_padding_filters_the_padded_input():
    torch.manual_seed(1)
    conv = GFConv2d(2, 3, 3, padding=1, padding_mode='reflect', radius=2)
    x, grad_out = torch.randn(1, 2, 8, 8), torch.randn(1, 3, 8, 8)
    out, gx, gw = _grads(conv, x, grad_out)
    xr = x.clone().requires_grad_()
    wr = conv.weight.detach().clone().requires_grad_()
    padded = F.pad(xr, (1, 1, 1, 1), mode='reflect')
    ref = gradient_filtered_conv2d(padded, wr, conv.bias.detach(), 1, 0, 1,
                                   1, 2)
    assert torch.equal(out, ref)
    ref.backward(grad_out)
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(gw, wr.grad)


@pytest.mark.parametrize('radius', [0, -2, 1.5])
def test_bad_radius_in_constructor(radius):
    with pytest.raises(ValueError, match='radius'):
        GFConv2d(3, 3, 3, radius=radius)


def test_operator_and_gfconv2d_import_without_mmseg():
    """Plain PyTorch users (and the GPU benchmark machine) have no mmseg."""
    import subprocess
    import sys
    code = ('import sys; sys.modules["mmseg"] = None\n'
            'import torch, mmseg_gf\n'
            'conv = mmseg_gf.GFConv2d(3, 4, 3, padding=1, radius=2)\n'
            'conv(torch.randn(1, 3, 8, 8)).sum().backward()\n'
            'assert conv.weight.grad is not None\n'
            'assert "mmseg_gf.engine" not in sys.modules\n')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_call_plans_follow_the_radius_the_switch_and_the_shape(monkeypatch):
    """A call's plan (implementation, arguments, output patches) is decided
    once per call signature and decided again after a change of radius,
    filter switch, grad mode or input shape: the gradients are always the
    operator's at the radius of the moment."""
    from mmseg_gf.models import call_plans
    chosen = []
    new_plan = GFConv2d._new_plan

    def counting(self, *call):
        chosen.append('conv')
        return new_plan(self, *call)

    monkeypatch.setattr(GFConv2d, '_new_plan', counting)
    torch.manual_seed(0)
    conv = GFConv2d(4, 6, 3, stride=2, padding=1, radius=2)
    x, grad_out = torch.randn(2, 4, 15, 13), torch.randn(2, 6, 8, 7)

    def reference(radius):
        xr = x.clone().requires_grad_()
        wr = conv.weight.detach().clone().requires_grad_()
        gradient_filtered_conv2d(xr, wr, conv.bias.detach(), 2, 1, 1, 1,
                                 radius).backward(grad_out)
        return xr.grad, wr.grad

    for radius in (2, 2, 4, 2):
        conv.radius = radius
        _, gx, gw = _grads(conv, x, grad_out)
        want_x, want_w = reference(radius)
        torch.testing.assert_close(gx, want_x)
        torch.testing.assert_close(gw, want_w)
    assert chosen == ['conv', 'conv']  # radius 2, then 4; 2 kept
    out = conv(x.requires_grad_())
    assert out.grad_fn is not None
    conv.enabled = False
    _, gx, _ = _grads(conv, x, grad_out)
    exact = nn.Conv2d(4, 6, 3, stride=2, padding=1)
    exact.load_state_dict(conv.state_dict())
    _, px, _ = _grads(exact, x, grad_out)
    torch.testing.assert_close(gx, px)
    with torch.no_grad():
        assert torch.equal(conv(x), exact(x))
    conv.enabled = True
    _grads(conv, torch.randn(1, 4, 9, 9), torch.randn(1, 6, 5, 5))
    # radius 2 and 4; disabled, with and without grad mode; another shape
    assert chosen == ['conv'] * 5
    assert len(call_plans.kept_plans(conv, 'conv_plans')) <= \
        call_plans.CACHE_SIZE
