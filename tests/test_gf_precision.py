"""Dtypes, devices, torch.compile: the operator behaves like a conv."""
import pytest
import torch

from mmseg_gf import GFConv2d
from mmseg_gf.ops import gradient_filtered_conv2d

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason='no CUDA GPU on this machine')


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


@CUDA
def test_cuda_float64_matches_reference_over_the_grid():
    """Same grid as the CPU reference test, op on the GPU (float64)."""
    from tests.gf_reference import reference_gradients
    from tests.test_gf_op import GRID, _conv_case, _run_op
    for stride, kernel, dilation, groups, radius in GRID:
        g = 1 if groups == '1' else 4
        x, w, b, gy, s, p, d = _conv_case(radius, 2, 4, 4, (13, 11), kernel,
                                          stride, dilation, g)
        out, gx, gw, gb = _run_op(x.cuda(), w.cuda(), b.cuda(), gy.cuda(), s,
                                  p, d, g, radius)
        assert gx.is_cuda and gw.is_cuda and gb.is_cuda
        ref_x, ref_w, ref_b = reference_gradients(x, w, gy, s, p, d, g,
                                                  radius)
        torch.testing.assert_close(gx.cpu(), ref_x, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(gw.cpu(), ref_w, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(gb.cpu(), ref_b, rtol=1e-9, atol=1e-9)
