"""Lean modules: the same forward and gradients as the plain modules, while
keeping only a scale, one bit per element, or the low-resolution logits.

References are the plain torch modules themselves (autograd's own formulas).
"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.models.lean import is_lean, make_lean, make_plain
from mmseg_gf.ops.bit_mask import masks as bit_mask
from mmseg_gf.ops.frozen_norm import gpu as triton_norm
from tests.helpers.devices import (DEVICE_PATHS, DEVICES, kernels_off,
                                   needs_cuda, on_path)

ACTIVATIONS = {
    'relu': lambda inplace: nn.ReLU(inplace=inplace),
    'relu6': lambda inplace: nn.ReLU6(inplace=inplace),
    'hardtanh': lambda inplace: nn.Hardtanh(-0.5, 0.7, inplace=inplace),
    'leaky': lambda inplace: nn.LeakyReLU(0.1, inplace=inplace),
}


def _special_values(shape, seed=0):
    """Random values with exact zeros, the bounds, +-inf and NaN mixed in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 4
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 6.0, -0.5, 0.7, float('inf'),
                             -float('inf'), float('nan')])
    idx = torch.randperm(flat.numel(), generator=gen)[:specials.numel()]
    flat[idx] = specials[:idx.numel()]
    return x


@pytest.mark.parametrize('numel', [1, 7, 8, 9, 64, 1001])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64,
                                   torch.bfloat16])
def test_pack_native_equals_fallback(numel, dtype):
    if not bit_mask.native_available():
        pytest.skip('compiled bit-mask kernels not built')
    x = _special_values((numel, ), seed=numel).to(dtype)
    for lo, hi, nan_bit in [(0.0, None, True), (0.0, 6.0, True),
                            (0.0, None, False), (-0.5, 0.7, True)]:
        native = bit_mask.pack(x, lo, hi, nan_bit)
        with kernels_off():
            fallback = bit_mask.pack(x, lo, hi, nan_bit)
        assert native.dtype == torch.uint8
        assert native.numel() == bit_mask.packed_bytes(numel)
        assert torch.equal(native, fallback)
        # independent reading of the layout: bit i%8 of byte i//8
        bits = [(int(native[i // 8]) >> (i % 8)) & 1 for i in range(numel)]
        v = x.float() if dtype == torch.bfloat16 else x  # own precision
        want = (v > lo) & (v < (hi if hi is not None else float('inf')))
        if hi is None:
            want |= v == float('inf')
        want = torch.where(v.isnan(), torch.tensor(nan_bit), want)
        assert bits == want.int().tolist()
        g = torch.randn(numel).to(dtype)
        for off in (0.0, 0.1):
            a = bit_mask.apply(g, native, off)
            with kernels_off():
                b = bit_mask.apply(g, native, off)
            assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize('layout', [torch.contiguous_format,
                                    torch.channels_last])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_pack_and_apply_on_cuda_equal_cpu(dtype, layout):
    """The PyTorch path on CUDA tensors writes the CPU's bytes and applies
    them to the CPU's gradient."""
    x = _special_values((2, 5, 3, 7), seed=3).to(dtype).contiguous(
        memory_format=layout)
    g = torch.randn(x.shape).to(dtype).contiguous(memory_format=layout)
    for lo, hi, nan_bit in [(0.0, None, True), (-0.5, 0.7, False)]:
        bits = bit_mask.pack(x, lo, hi, nan_bit, layout=layout)
        bits_cuda = bit_mask.pack(x.cuda(), lo, hi, nan_bit, layout=layout)
        assert bits_cuda.is_cuda and torch.equal(bits_cuda.cpu(), bits)
        for off in (0.0, 0.1):
            got = bit_mask.apply(g.cuda(), bits_cuda, off, layout)
            assert got.is_cuda
            assert torch.equal(got.cpu(),
                               bit_mask.apply(g, bits, off, layout))


@pytest.mark.parametrize('name', sorted(ACTIVATIONS))
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('device_path', DEVICE_PATHS)
def test_activation_same_forward_and_grad(name, inplace, device_path):
    with on_path(device_path) as device:
        _check_activation(name, inplace, device)


def _check_activation(name, inplace, device):
    plain = ACTIVATIONS[name](inplace)
    lean = ACTIVATIONS[name](inplace)
    assert make_lean(lean) == 'activation' and is_lean(lean)
    assert isinstance(lean, type(plain))
    x0 = _special_values((2, 3, 5, 7), seed=1)
    outs, grads = zip(*run_both((plain, lean), x0, torch.randn(2, 3, 5, 7),
                                device=device))
    assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    if name in ('relu6', 'hardtanh'):
        # torch's own Hardtanh backward passes a NaN's gradient in its
        # scalar loop and zeroes it in its vector loop: no reference there
        grads = [gr[~x0.isnan()] for gr in grads]
    assert torch.equal(grads[0].nan_to_num(), grads[1].nan_to_num())


@pytest.mark.parametrize('device_path', DEVICE_PATHS)
@pytest.mark.parametrize('name', ['relu', 'leaky'])
def test_activation_of_channels_last_input_copies_nothing(name, device_path):
    """A channels-last input (Segformer's maps, say) is masked in its own
    memory order: same gradient as autograd's, given back channels-last,
    and neither pass copies the map."""
    with on_path(device_path) as device:
        _check_channels_last_activation(name, device)


def _check_channels_last_activation(name, device):
    plain, lean = ACTIVATIONS[name](False), ACTIVATIONS[name](False)
    make_lean(lean)
    x0 = _special_values((2, 6, 5, 7), seed=2).contiguous(
        memory_format=torch.channels_last).to(device)
    g = torch.randn(2, 6, 5, 7).contiguous(
        memory_format=torch.channels_last).to(device)
    assert bit_mask.layout_of(x0) is torch.channels_last
    results = []
    for m in (plain, lean):
        x = x0.clone().requires_grad_(True)
        m(x * 1.0).backward(g)
        results.append(x.grad)
    assert torch.equal(results[0].nan_to_num(), results[1].nan_to_num())
    x = x0.clone().requires_grad_(True)
    with torch.profiler.profile() as prof:
        lean(x * 1.0).backward(g)
    assert not [e for e in prof.events()
                if e.name in ('aten::clone', 'aten::contiguous')]
    bits = bit_mask.pack(x0, layout=torch.channels_last)
    keep = bit_mask.unpack(bits, x0.shape, torch.channels_last)
    assert torch.equal(keep, (x0 > 0) | x0.isnan())


def test_activation_keeps_bits_only():
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    lean = make_lean_copy(nn.ReLU(inplace=True))
    plain_bytes = saved_tensor_bytes(lambda: nn.ReLU()(x * 1.0))
    lean_bytes = saved_tensor_bytes(lambda: lean(x * 1.0))
    assert plain_bytes == x.numel() * 4
    assert lean_bytes == x.numel() // 8


def make_lean_copy(module):
    module = copy.deepcopy(module)
    make_lean(module)
    return module


def run_both(modules, x0, g, seed=None, device='cpu'):
    """Forward ``x0`` (as a non-leaf, as in a network) and backward ``g``
    through each module on ``device``; returns ``[(output, input
    gradient)]`` on the CPU."""
    results = []
    for m in modules:
        m.to(device)
        if seed is not None:
            torch.manual_seed(seed)
        x = x0.to(device).clone().requires_grad_(True)
        y = m(x * 1.0)
        assert y.device.type == device
        y.backward(g.to(device))
        results.append((y.detach().cpu(), x.grad.cpu()))
    return results


def _frozen_bn(channels, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(channels)
    bn.running_mean.copy_(torch.randn(channels, generator=gen))
    bn.running_var.copy_(torch.rand(channels, generator=gen) + 0.1)
    with torch.no_grad():
        bn.weight.copy_(torch.randn(channels, generator=gen))
        bn.bias.copy_(torch.randn(channels, generator=gen))
    bn.requires_grad_(False)
    return bn.eval()


@pytest.mark.parametrize('device', DEVICES)
def test_frozen_norm_same_forward_grad_and_keeps_scale(device):
    plain = _frozen_bn(6)
    lean = make_lean_copy(plain)
    assert isinstance(lean, nn.BatchNorm2d)
    x0 = torch.randn(3, 6, 9, 11)
    res = run_both((plain, lean), x0, torch.randn(3, 6, 9, 11),
                   device=device)
    assert torch.equal(res[0][0], res[1][0])
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-6, atol=0)
    x = x0.to(device).clone().requires_grad_(True)
    # (the Triton path recomputes the factor in the backward: nothing kept)
    kept = 0 if triton_norm.usable(x) else 6 * 4
    assert saved_tensor_bytes(lambda: lean(x)) == kept
    assert saved_tensor_bytes(lambda: plain(x)) >= x.numel() * 4


def test_norm_in_train_mode_or_trainable_is_plain():
    lean = make_lean_copy(_frozen_bn(4))
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    lean.weight.requires_grad_(True)
    assert saved_tensor_bytes(lambda: lean(x)) >= x.numel() * 4
    lean.weight.requires_grad_(False)
    lean.train()
    assert saved_tensor_bytes(lambda: lean(x)) >= x.numel() * 4


@pytest.mark.parametrize('device_path', DEVICE_PATHS)
def test_dropout_same_draws_grad_and_bits(device_path):
    with on_path(device_path) as device:
        plain, lean = nn.Dropout(0.3), make_lean_copy(nn.Dropout(0.3))
        x0 = torch.randn(2, 5, 8, 9)
        res = run_both((plain, lean), x0, torch.randn(2, 5, 8, 9), seed=7,
                       device=device)
        assert torch.equal(res[0][0], res[1][0])
        assert torch.equal(res[0][1], res[1][1])
        x = x0.to(device).clone().requires_grad_(True)
        assert saved_tensor_bytes(lambda: lean(x * 1.0)) == \
            bit_mask.packed_bytes(x.numel())
        lean.eval()
        assert torch.equal(lean(x), x)


@pytest.mark.parametrize('size', [(2, 2), (3, 6), 6, (None, 3)])
def test_adaptive_pool_keeps_shape_only(size):
    plain = nn.AdaptiveAvgPool2d(size)
    lean = make_lean_copy(plain)
    x0 = torch.randn(2, 4, 13, 11)
    res = run_both((plain, lean), x0, torch.randn_like(plain(x0)))
    assert torch.equal(res[0][0], res[1][0])
    assert torch.equal(res[0][1], res[1][1])
    x = x0.clone().requires_grad_(True)
    assert saved_tensor_bytes(lambda: plain(x * 1.0)) == x.numel() * 4
    assert saved_tensor_bytes(lambda: lean(x * 1.0)) == 0


def test_make_plain_restores_class():
    m = nn.ReLU6()
    make_lean(m)
    assert type(m).__name__ == 'LeanReLU6'
    assert make_plain(m) and type(m) is nn.ReLU6 and not is_lean(m)
    assert make_lean(nn.GELU()) is None
    assert make_lean(nn.Dropout2d(0.1)) is None


@settings(max_examples=25, deadline=None)
@given(act=st.sampled_from(sorted(ACTIVATIONS)),
       inplace=st.booleans(),
       stride=st.sampled_from([1, 2]),
       kernel=st.sampled_from([1, 3]),
       radius=st.sampled_from([1, 2, 4]),
       size=st.integers(5, 13),
       p=st.sampled_from([0.0, 0.2]),
       seed=st.integers(0, 2**16))
def test_random_chain_equals_plain(act, inplace, stride, kernel, radius,
                                   size, p, seed):
    """conv (GF) -> frozen BN -> activation -> dropout -> conv (GF): the lean
    chain gives the plain chain's loss and gradients."""
    from mmseg_gf import GFConv2d
    torch.manual_seed(seed)
    chain = nn.Sequential(
        GFConv2d(3, 6, kernel, stride, kernel // 2, radius=radius),
        _frozen_bn(6, seed), ACTIVATIONS[act](inplace), nn.Dropout(p),
        GFConv2d(6, 4, 3, 1, 1, radius=radius)).train()
    chain[1].eval()
    lean = copy.deepcopy(chain)
    for m in lean:
        make_lean(m)
    x = torch.randn(2, 3, size, size)
    results = []
    for net in (chain, lean):
        net.zero_grad()
        torch.manual_seed(seed + 1)
        loss = net(x).square().mean()
        loss.backward()
        results.append((loss.detach(),
                        [q.grad.clone() for q in net.parameters()
                         if q.requires_grad]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
