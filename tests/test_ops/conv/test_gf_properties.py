"""Property-based tests of the operator over random conv settings."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmseg_gf.ops import gradient_filtered_conv2d
from tests.helpers.gf_reference import reference_gradients


def draw_channels_and_kernel(draw):
    """Groups, in/out channels divisible by them, and a kernel size."""
    groups = draw(st.sampled_from([1, 2, 3]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    return groups, cin, cout, kh, kw


@st.composite
def conv_settings(draw):
    groups, cin, cout, kh, kw = draw_channels_and_kernel(draw)
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, kh)), draw(st.integers(0, kw))
    # Smallest input the conv accepts, plus a little.
    h = max(1, (kh - 1) * dh + 1 - 2 * ph) + draw(st.integers(0, 9))
    w = max(1, (kw - 1) * dw + 1 - 2 * pw) + draw(st.integers(0, 9))
    radius = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    return dict(groups=groups, cin=cin, cout=cout, kernel=(kh, kw),
                stride=(sh, sw), dilation=(dh, dw), padding=(ph, pw),
                size=(h, w), radius=radius, seed=seed)


@settings(max_examples=120, deadline=None)
@given(conv_settings())
def test_random_convs_match_reference(cfg):
    gen = torch.Generator().manual_seed(cfg['seed'])
    x = torch.randn(2, cfg['cin'], *cfg['size'], generator=gen,
                    dtype=torch.float64, requires_grad=True)
    w = torch.randn(cfg['cout'], cfg['cin'] // cfg['groups'], *cfg['kernel'],
                    generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(cfg['cout'], generator=gen, dtype=torch.float64,
                    requires_grad=True)
    args = (cfg['stride'], cfg['padding'], cfg['dilation'], cfg['groups'])
    out = gradient_filtered_conv2d(x, w, b, *args, radius=cfg['radius'])
    assert torch.equal(out, F.conv2d(x, w, b, *args))
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad_out)
    for grad, like in ((x.grad, x), (w.grad, w), (b.grad, b)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.device == like.device
    ref_x, ref_w, ref_b = reference_gradients(x, w, grad_out, *args,
                                              cfg['radius'])
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(b.grad, ref_b, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------
# GFConv2d, the module users get: every setting nn.Conv2d accepts.

import warnings  # noqa: E402

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from mmseg_gf import GFConv2d  # noqa: E402
from mmseg_gf.models.gf_conv import GFExactBackwardWarning  # noqa: E402

from tests.helpers.devices import DEVICES  # noqa: E402

PADDING_MODES = ('zeros', 'reflect', 'replicate', 'circular')


@st.composite
def module_settings(draw):
    """Any nn.Conv2d construction plus an input it may or may not accept."""
    groups, cin, cout, kh, kw = draw_channels_and_kernel(draw)
    padding_kind = draw(st.sampled_from(['int', 'pair', 'same', 'valid']))
    if padding_kind == 'same':  # nn.Conv2d refuses 'same' with stride > 1
        sh = sw = 1
    else:
        sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    if padding_kind == 'int':
        padding = draw(st.integers(0, max(kh, kw)))
    elif padding_kind == 'pair':
        padding = (draw(st.integers(0, kh)), draw(st.integers(0, kw)))
    else:
        padding = padding_kind
    return dict(
        cin=cin, cout=cout, kernel=(kh, kw), stride=(sh, sw),
        padding=padding, dilation=(dh, dw), groups=groups,
        bias=draw(st.booleans()),
        padding_mode=draw(st.sampled_from(PADDING_MODES)),
        size=(_size(draw, kh, dh, padding, 0), _size(draw, kw, dw, padding,
                                                     1)),
        batch=draw(st.sampled_from([None, 1, 2])),  # None: unbatched C,H,W
        radius=draw(st.integers(1, 8)),
        input_grad=draw(st.booleans()),
        weight_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)))


def _size(draw, k, d, padding, axis):
    """A tiny / odd map size along one axis: mostly just above the least
    the conv accepts, sometimes any size from 1 (which it may refuse)."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.integers(1, 17))
    if padding in ('same', 'valid'):
        p = 0
    else:
        p = padding if isinstance(padding, int) else padding[axis]
    least = max(1, (k - 1) * d + 1 - (0 if padding == 'same' else 2 * p))
    return least + draw(st.integers(0, 9))


def _explicit_padding(cfg):
    """(left, right, top, bottom) of nn.Conv2d's padding, computed here."""
    pads = []
    for axis in (1, 0):  # F.pad order: width first
        k, d = cfg['kernel'][axis], cfg['dilation'][axis]
        if cfg['padding'] == 'same':
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]  # extra one after
        elif cfg['padding'] == 'valid':
            pads += [0, 0]
        else:
            p = cfg['padding']
            p = p if isinstance(p, int) else p[axis]
            pads += [p, p]
    return pads


def _reference_module_grads(cfg, x, weight, grad_out):
    """docs/gradient_filter.md in float64 for a module conv: pad explicitly
    as nn.Conv2d does, apply the formulas with zero padding, then back
    through the pad."""
    x64 = x.detach().cpu().double().requires_grad_()
    weight, grad_out = weight.detach().cpu(), grad_out.cpu()
    batched = x64 if x64.dim() == 4 else x64.unsqueeze(0)
    mode = 'constant' if cfg['padding_mode'] == 'zeros' else \
        cfg['padding_mode']
    padded = F.pad(batched, _explicit_padding(cfg), mode=mode)
    gy = grad_out.double()
    gy = gy if gy.dim() == 4 else gy.unsqueeze(0)
    ref_xp, ref_w, ref_b = reference_gradients(
        padded.detach(), weight.detach(), gy, cfg['stride'], (0, 0),
        cfg['dilation'], cfg['groups'], cfg['radius'])
    (ref_x, ) = torch.autograd.grad(padded, x64, ref_xp)
    return ref_x, ref_w, ref_b


def _check_module(cfg, device, dtype):
    gen = torch.Generator().manual_seed(cfg['seed'])
    kwargs = dict(stride=cfg['stride'], padding=cfg['padding'],
                  dilation=cfg['dilation'], groups=cfg['groups'],
                  bias=cfg['bias'], padding_mode=cfg['padding_mode'])
    plain = nn.Conv2d(cfg['cin'], cfg['cout'], cfg['kernel'], **kwargs)
    gf = GFConv2d(cfg['cin'], cfg['cout'], cfg['kernel'],
                  radius=cfg['radius'], **kwargs)
    gf.load_state_dict(plain.state_dict())
    plain.to(device, dtype)
    gf.to(device, dtype)
    for module in (plain, gf):
        module.weight.requires_grad_(cfg['weight_grad'])
    shape = (cfg['cin'], *cfg['size'])
    if cfg['batch'] is not None:
        shape = (cfg['batch'], ) + shape
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(
        device, dtype)
    try:
        expected = plain(x)
    except (RuntimeError, ValueError, NotImplementedError):
        # nn.Conv2d refuses this input (too small for the kernel, padding
        # wider than the map for reflect/circular...): so must GFConv2d.
        with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
            gf(x)
        return False
    x.requires_grad_(cfg['input_grad'])
    with warnings.catch_warnings():
        warnings.simplefilter('error', GFExactBackwardWarning)  # no fallback
        out = gf(x)
    assert torch.equal(out, expected)
    assert out.dtype == expected.dtype and out.device == expected.device
    if not out.requires_grad:  # nothing to train: a plain convolution
        assert not (cfg['input_grad'] or cfg['weight_grad'] or cfg['bias'])
        return True
    grad_out = torch.randn(out.shape, generator=gen,
                           dtype=torch.float64).to(device, dtype)
    out.backward(grad_out)
    ref_x, ref_w, ref_b = _reference_module_grads(cfg, x, gf.weight,
                                                  grad_out)
    pairs = [(x.grad, x, ref_x, cfg['input_grad']),
             (gf.weight.grad, gf.weight, ref_w, cfg['weight_grad'])]
    if cfg['bias']:
        pairs.append((gf.bias.grad, gf.bias, ref_b, True))
    for grad, like, ref, wanted in pairs:
        if not wanted:
            assert grad is None
            continue
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.device == like.device
        ref = ref.reshape(like.shape).to(dtype)
        if dtype == torch.float64:
            torch.testing.assert_close(grad.cpu(), ref, rtol=1e-9, atol=1e-9)
        else:
            scale = max(1.0, float(ref.abs().max()))
            torch.testing.assert_close(grad.cpu(), ref, rtol=1e-4,
                                       atol=1e-5 * scale)
    return True


@pytest.mark.parametrize('device', DEVICES)
@settings(max_examples=150, deadline=None)
@given(cfg=module_settings(), dtype=st.sampled_from([torch.float32,
                                                     torch.float64]))
def test_gfconv2d_any_valid_conv(device, cfg, dtype):
    """Every nn.Conv2d setting and input: same output as nn.Conv2d (bit for
    bit), gradients with the parameters' shapes / dtypes / devices and equal
    to the float64 reference (tests/helpers/gf_reference.py); what nn.Conv2d
    refuses GFConv2d refuses too; no exact-backward fallback for any real
    conv."""
    _check_module(cfg, device, dtype)


@pytest.mark.parametrize('case', [
    # 'same' with even kernels: one extra pixel after, as F.conv2d pads
    dict(padding='same', kernel=(4, 2), padding_mode='reflect'),
    dict(padding='same', kernel=(3, 6), padding_mode='circular'),
    dict(padding=(3, 0), kernel=(3, 3), padding_mode='replicate'),
    dict(padding=0, kernel=(7, 1), batch=2),
    # taps in other patches (d >= r*s) along one axis, not the other
    dict(padding=(4, 2), kernel=(3, 3), dilation=(4, 1), radius=2),
    # strided, map smaller than r: one patch covers it all
    dict(padding=1, kernel=(3, 3), stride=(2, 3), dilation=(1, 1),
         size=(5, 4), radius=8),
    # depthwise, valid padding, frozen weight (input gradient only)
    dict(padding='valid', kernel=(5, 5), groups=4, cout=4,
         weight_grad=False, bias=False),
])
def test_gfconv2d_named_corner_cases(case):
    """Fixed corners, so a strategy edit cannot silently drop them."""
    base = dict(cin=4, cout=6, stride=(1, 1), dilation=(2, 3), groups=2,
                bias=True, size=(15, 16), batch=None, radius=3,
                input_grad=True, weight_grad=True, seed=5,
                padding_mode='zeros')
    assert _check_module(dict(base, **case), 'cpu', torch.float64)


def test_complex_conv_falls_back_to_exact_backward_with_a_warning():
    """The one kind docs/gradient_filter.md does not define: complex
    tensors. GFConv2d runs the exact backward there and says so, once per
    layer."""
    torch.manual_seed(0)
    kwargs = dict(padding=1, dtype=torch.complex64)
    gf = GFConv2d(3, 4, 3, radius=2, **kwargs)
    plain = nn.Conv2d(3, 4, 3, **kwargs)
    plain.load_state_dict(gf.state_dict())
    x = torch.randn(2, 3, 8, 8, dtype=torch.complex64)
    grads = []
    for module in (gf, plain):
        xi = x.clone().requires_grad_()
        if module is gf:
            with pytest.warns(GFExactBackwardWarning,
                              match='exact backward for complex-valued'):
                out = module(xi)
        else:
            out = module(xi)
        out.abs().square().sum().backward()
        grads.append((out, xi.grad, module.weight.grad, module.bias.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    with warnings.catch_warnings():  # once per layer, not every call
        warnings.simplefilter('error', GFExactBackwardWarning)
        gf(x.clone().requires_grad_()).abs().sum().backward()
    # a real input through the same kind of layer is filtered, no warning
    real = GFConv2d(3, 4, 3, padding=1, radius=2)
    with warnings.catch_warnings():
        warnings.simplefilter('error', GFExactBackwardWarning)
        xr = torch.randn(2, 3, 8, 8, requires_grad=True)
        real(xr).sum().backward()
    exact = nn.Conv2d(3, 4, 3, padding=1)
    exact.load_state_dict(real.state_dict())
    xe = xr.detach().clone().requires_grad_()
    exact(xe).sum().backward()
    assert not torch.allclose(xr.grad, xe.grad)


def test_empty_tensors_run_like_nn_conv2d():
    """Zero-size batches and channels: nothing to filter, exact results."""
    for cin, batch in ((3, 0), (0, 2)):
        gf = GFConv2d(cin, 4, 3, padding=1, radius=2)
        plain = nn.Conv2d(cin, 4, 3, padding=1)
        plain.load_state_dict(gf.state_dict())
        outs = []
        for module in (gf, plain):
            x = torch.randn(batch, cin, 6, 6, requires_grad=True)
            out = module(x)
            out.sum().backward()
            outs.append((out, x.grad, module.weight.grad))
        for a, b in zip(*outs):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)

