"""Dtypes, devices, torch.compile: the operator behaves like a conv."""
import pytest
import torch

from mmseg_gf import GFConv2d
from mmseg_gf.ops import gradient_filtered_conv2d

from tests.helpers.devices import needs_cuda

CUDA = needs_cuda
CUDA_MARKS = [pytest.mark.cuda, needs_cuda]


def _grads(x, w, grad_out, **autocast):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if autocast:
        with torch.autocast(**autocast):
            out = gradient_filtered_conv2d(x, w, None, 2, 1, 1, 1, 4)
    else:
        out = gradient_filtered_conv2d(x, w, None, 2, 1, 1, 1, 4)
    out.backward(grad_out.to(out.dtype))
    return out, x.grad, w.grad


def _case(device='cpu'):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 32, 32, generator=gen).to(device)
    w = (torch.randn(16, 8, 3, 3, generator=gen) * 0.2).to(device)
    g = torch.randn(2, 16, 16, 16, generator=gen).to(device)
    return x, w, g


def test_float32_agrees_with_float64():
    x, w, g = _case()
    _, gx32, gw32 = _grads(x, w, g)
    _, gx64, gw64 = _grads(x.double(), w.double(), g.double())
    assert gx32.dtype == torch.float32 and gx64.dtype == torch.float64
    torch.testing.assert_close(gx32, gx64.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw32, gw64.float(), rtol=1e-5, atol=1e-4)


def test_bfloat16_autocast_stated_tolerance():
    """bf16 rounds the forward and the pooled sums to 8 mantissa bits;
    accumulation is float32, so errors stay within 2% of the scale."""
    x, w, g = _case()
    _, gx, gw = _grads(x, w, g)
    out, bx, bw = _grads(x, w, g, device_type='cpu', dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and bx.dtype == torch.float32
    scale_x, scale_w = gx.abs().max(), gw.abs().max()
    assert (bx - gx).abs().max() <= 0.02 * scale_x
    assert (bw - gw).abs().max() <= 0.02 * scale_w


@pytest.mark.cuda
@CUDA
def test_cuda_float32_and_float16_autocast():
    x, w, g = _case('cuda')
    out, gx, gw = _grads(x, w, g)
    assert gx.device.type == 'cuda' and gw.device.type == 'cuda'
    cx, cw, cg = _case()
    _, rx, rw = _grads(cx, cw, cg)
    torch.testing.assert_close(gx.cpu(), rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw.cpu(), rw, rtol=1e-4, atol=1e-3)
    out, hx, hw = _grads(x, w, g, device_type='cuda', dtype=torch.float16)
    assert out.dtype == torch.float16 and hx.dtype == torch.float32
    assert (hx - gx).abs().max() <= 0.01 * gx.abs().max()
    assert (hw - gw).abs().max() <= 0.01 * gw.abs().max()


def test_torch_compile_gives_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(GFConv2d(3, 4, 3, padding=1, radius=2),
                                torch.nn.ReLU())
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model(x).sum().backward()
    ref_x, ref_w = x.grad.clone(), model[0].weight.grad.clone()
    x.grad = None
    model.zero_grad()
    compiled = torch.compile(model, backend='aot_eager')
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x)
    torch.testing.assert_close(model[0].weight.grad, ref_w)


# ----------------------------------------------------------------------------
# Accumulation in float32, non-finite gradients, channels_last, compile

from torch import nn  # noqa: E402

from tests.helpers.gf_reference import reference_gradients  # noqa: E402

DEVICES = ['cpu', pytest.param('cuda', marks=CUDA_MARKS)]


def _big_sum_case(dtype, device, low=0.0, gy_scale=1.0):
    """A 1x1 conv over a 256x256 map: g_W and g_b are sums of 65536 terms.

    A bfloat16 accumulator stalls at 256 (its spacing there is 2 > every
    term), a float16 one overflows past 65504; float32 accumulation gets
    both right to ~1e-4.
    """
    gen = torch.Generator().manual_seed(0)
    x = (low + (1 - low) * torch.rand(1, 1, 256, 256, generator=gen))
    gy = gy_scale * (1 + torch.rand(1, 1, 256, 256, generator=gen))
    return x.to(device, dtype), gy.to(device, dtype)


@pytest.mark.parametrize('device,dtype', [
    ('cpu', torch.bfloat16), ('cpu', torch.float16),
    pytest.param('cuda', torch.float16, marks=CUDA_MARKS),
    pytest.param('cuda', torch.bfloat16, marks=CUDA_MARKS)
])
def test_autocast_accumulates_in_float32(device, dtype):
    """Reduced-precision activations and output gradients (what a layer
    after an autocast layer sees), float32 weights: the weight and bias
    gradients are long sums, accumulated in float32 and returned in the
    weights' dtype. float16 case: the totals (~1e5) exceed float16's range
    and must still come out finite and right."""
    conv = GFConv2d(1, 1, 1, radius=8).to(device)
    gy_scale = 1.0 if dtype == torch.bfloat16 else 2.0
    x, gy = _big_sum_case(dtype, device, low=0.5, gy_scale=gy_scale)
    x.requires_grad_()
    with torch.autocast(device, dtype=dtype):
        out = conv(x)
    assert out.dtype == dtype
    out.backward(gy)
    ref_x, ref_w, ref_b = reference_gradients(
        x.detach().cpu(), conv.weight.detach().cpu(), gy.cpu(), (1, 1),
        (0, 0), (1, 1), 1, 8)
    assert conv.weight.grad.dtype == conv.bias.grad.dtype == torch.float32
    if dtype == torch.float16:
        assert ref_w.item() > 65504 and ref_b.item() > 65504
    for grad, ref in ((conv.weight.grad, ref_w), (conv.bias.grad, ref_b)):
        assert torch.isfinite(grad).all()
        rel = ((grad.cpu().double() - ref).abs().max() / ref.abs().max())
        assert rel < 1e-3, rel  # float32 sums of rounded patch sums
    # g_x: one rounding to the input's dtype on top (2^-8 for bfloat16)
    assert x.grad.dtype == dtype
    rel_x = (x.grad.cpu().double() - ref_x).abs().max() / ref_x.abs().max()
    assert rel_x < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel_x


def test_bfloat16_module_accumulates_in_float32():
    """All-bfloat16 layer (weights too): sums in float32, one final rounding
    of each gradient to bfloat16 (relative error <= 2^-8)."""
    conv = GFConv2d(1, 1, 1, radius=8).to(torch.bfloat16)
    x, gy = _big_sum_case(torch.bfloat16, 'cpu')
    x.requires_grad_()
    conv(x).backward(gy)
    _, ref_w, ref_b = reference_gradients(x.detach(), conv.weight.detach(),
                                          gy, (1, 1), (0, 0), (1, 1), 1, 8)
    assert conv.weight.grad.dtype == torch.bfloat16
    assert ref_w.item() > 4 * 256  # far past where bf16 accumulation stalls
    for grad, ref in ((conv.weight.grad, ref_w), (conv.bias.grad, ref_b)):
        assert (grad.double() - ref).abs().max() <= 2**-8 * ref.abs().max()


# Conv kinds: (cin, cout, kernel, stride, padding, dilation, groups, radius)
KINDS = {
    '3x3': (4, 6, 3, 1, 1, 1, 1, 4),
    'strided': (4, 6, 3, 2, 1, 1, 1, 2),
    'depthwise': (6, 6, 3, 1, 1, 1, 6, 4),
    'grouped_1x1': (6, 4, 1, 1, 0, 1, 2, 3),
    'dilated_pooled': (4, 6, 3, 1, 4, 4, 1, 2),  # d >= r: taps on the grid
}


@pytest.mark.parametrize('kind', sorted(KINDS))
@pytest.mark.parametrize('value', [float('nan'), float('inf'),
                                   float('-inf')])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64,
                                   torch.bfloat16])
def test_non_finite_output_grad_propagates(kind, value, dtype):
    """A NaN / Inf in g_y reaches every gradient it feeds (never zeroed):
    the input pixels of its patch, its output channel's weight and bias
    gradients; gradients it does not feed stay finite."""
    cin, cout, k, s, p, d, g, r = KINDS[kind]
    torch.manual_seed(0)
    conv = GFConv2d(cin, cout, k, s, p, d, g, radius=r).to(dtype)
    x = torch.randn(2, cin, 16, 16, dtype=dtype, requires_grad=True)
    out = conv(x)
    gy = torch.randn_like(out)
    co, pi, pj = 1, 1, 0  # output channel, patch (row, col)
    gy[1, co, pi * r + 1, pj * r] = value
    out.backward(gy)
    def bad(t):
        return ~torch.isfinite(t)

    group = co // (cout // g)
    cins = slice(group * (cin // g), (group + 1) * (cin // g))
    rows = slice(pi * r * s, (pi + 1) * r * s)
    cols = slice(pj * r * s, (pj + 1) * r * s)
    if KINDS[kind][5] == 1:  # Q(P) starts at c = ((k-1)*d)//2 - p = 0 here
        assert bad(x.grad[1, cins, rows, cols]).all()
        hit = torch.zeros_like(x.grad, dtype=torch.bool)
        hit[1, cins, rows, cols] = True
        assert torch.isfinite(x.grad[~hit]).all()
    else:  # the pooled transposed conv spreads it over the taps' patches
        assert bad(x.grad[1, cins, rows, cols]).all()
        assert torch.isfinite(x.grad[0]).all()
    assert bad(conv.weight.grad[co]).all() and bad(conv.bias.grad[co])
    others = [c for c in range(cout) if c != co]
    assert torch.isfinite(conv.weight.grad[others]).all()
    assert torch.isfinite(conv.bias.grad[others]).all()


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_channels_last_gives_the_same_gradients(kind):
    """A channels_last model and input (as torch.compile / AMP setups use):
    same output, same gradients as contiguous NCHW, gradients of the input
    in the input's memory format."""
    cin, cout, k, s, p, d, g, r = KINDS[kind]
    torch.manual_seed(0)
    ref = nn.Sequential(GFConv2d(cin, cout, k, s, p, d, g, radius=r),
                        nn.ReLU(), GFConv2d(cout, 5, 3, padding=1, radius=2))
    cl = nn.Sequential(GFConv2d(cin, cout, k, s, p, d, g, radius=r),
                       nn.ReLU(), GFConv2d(cout, 5, 3, padding=1, radius=2))
    cl.load_state_dict(ref.state_dict())
    cl = cl.to(memory_format=torch.channels_last)
    x = torch.randn(2, cin, 16, 12)
    results = []
    for model, fmt in ((ref, torch.contiguous_format),
                       (cl, torch.channels_last)):
        xi = x.clone(memory_format=fmt).requires_grad_()
        out = model(xi)
        gy = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        out.backward(gy.contiguous(memory_format=fmt))
        results.append((out, xi.grad, model[0].weight.grad,
                        model[2].weight.grad, model[0].bias.grad))
    assert results[1][1].is_contiguous(memory_format=torch.channels_last)
    assert results[1][2].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _compile_case():
    torch.manual_seed(0)
    # no bias before the BN: its gradient is ~0 by cancellation (BN removes
    # the mean), which compiled and eager round differently
    model = nn.Sequential(
        GFConv2d(3, 8, 3, padding=1, bias=False, radius=2), nn.BatchNorm2d(8),
        nn.ReLU(),
        GFConv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=8,
                 radius=2),
        GFConv2d(8, 4, 1, radius=4))
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    model(x).square().sum().backward()
    ref = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    return model, x, ref


@pytest.mark.parametrize('backend,fullgraph', [('inductor', False),
                                               ('aot_eager', True)])
def test_torch_compile_model(backend, fullgraph):
    """torch.compile with the default backend (inductor: generated C++ on
    CPU), and fullgraph=True (the whole forward and the filtered backward
    traced as one graph, no graph break): same gradients as eager."""
    torch._dynamo.reset()
    model, x, ref = _compile_case()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    compiled(x).square().sum().backward()
    got = [x.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4,
                                   atol=1e-5 * max(1.0, float(b.abs().max())))
