"""Cases of the frozen norms' Triton backward (batch norm, layer norm:
(``mmseg_gf.ops.frozen_norm.gpu``); run by ``tests/test_ops/lean/test_lean_triton.py``
in a subprocess (see ``tests/helpers/triton_cases.py``). Run directly::

    TRITON_INTERPRET=1 python -m pytest -q tests/helpers/triton_norm_cases.py
"""
import pytest
import torch
from torch import nn

from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.ops.frozen_norm import kernels as triton_norm_kernels
from tests.helpers.triton_runs import case_device, pytorch_path
from tests.helpers.triton_bit_mask_cases import (
    _assert_equal, _forward_backward, _lean)

DEVICE = case_device()


def _frozen_bn(channels, affine=True, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(channels, affine=affine)
    bn.running_mean.copy_(torch.randn(channels, generator=gen))
    bn.running_var.copy_(torch.rand(channels, generator=gen) + 0.1)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.randn(channels, generator=gen))
            bn.bias.copy_(torch.randn(channels, generator=gen))
    return bn.requires_grad_(False).eval().to(dtype)


def _run(module, x0, g):
    """Launches of the forward and the backward (see
    ``triton_bit_mask_cases._forward_backward``)."""
    return _forward_backward(module, x0, g, True, _COUNTED)


_COUNTED = (triton_norm_kernels, ('_frozen_norm_backward',
                                  '_frozen_layer_norm_backward'))


CASES = {
    'float32': (True, torch.float32, False),
    'channels_last': (True, torch.float32, True),
    'no_affine': (False, torch.float32, False),
    'float16': (True, torch.float16, False),
}


def _assert_same(a, b):
    if DEVICE == 'cpu':
        _assert_equal(a, b)
        return
    eps = torch.finfo(a.dtype).eps
    torch.testing.assert_close(a, b, rtol=2 * eps, atol=0, equal_nan=True)


@pytest.mark.parametrize('case', sorted(CASES))
def test_frozen_norm_gradient_equals_the_pytorch_path(case):
    """The lean norm on the Triton path: the plain forward (one op), the
    PyTorch path's gradient in one launch, nothing kept. Bit for bit under
    the interpreter; on a GPU against the PyTorch path on the same GPU, to
    rounding (its kernels round the scale's ``rsqrt`` and the product
    their own way: within 2 ulp)."""
    affine, dtype, channels_last = CASES[case]
    plain = _frozen_bn(6, affine, dtype)
    lean = _lean(plain).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 6, 5, 7, generator=gen).to(dtype)
    g = torch.randn(2, 6, 5, 7, generator=gen).to(dtype)
    if channels_last:
        x0, g = (t.contiguous(memory_format=torch.channels_last)
                 for t in (x0, g))
    with pytorch_path():
        want = _run(_lean(plain).to(DEVICE), x0.to(DEVICE), g.to(DEVICE))
    forward, backward = _run(lean, x0.to(DEVICE), g.to(DEVICE))
    for a, b in zip(forward.result, want[0].result):
        _assert_same(a.cpu(), b.cpu())
    assert forward.result[1].stride() == g.stride()
    assert forward.triton == [] and len(forward.ops) == 1, forward.ops
    assert backward.triton == ['_frozen_norm_backward']
    assert backward.ops == [], backward.ops
    x = x0.to(DEVICE).requires_grad_(True)
    assert saved_tensor_bytes(lambda: lean(x)) == 0


def test_running_variance_changed_in_place_is_an_error():
    lean = _lean(_frozen_bn(3)).to(DEVICE)
    x = torch.randn(1, 3, 2, 2, device=DEVICE, requires_grad=True)
    y = lean(x * 1.0)
    lean.running_var.mul_(2.0)
    with pytest.raises(RuntimeError, match='modified in place'):
        y.sum().backward()


@pytest.mark.parametrize('affine', [True, False])
def test_frozen_layer_norm_gradient_equals_the_pytorch_path(affine):
    """The lean frozen LayerNorm's backward on the Triton path: one launch,
    the PyTorch path's gradient up to rounding (and autograd's)."""
    gen = torch.Generator().manual_seed(2)
    plain = nn.LayerNorm(24, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            plain.weight.copy_(torch.randn(24, generator=gen))
            plain.bias.copy_(torch.randn(24, generator=gen))
    plain.requires_grad_(False)
    x0 = torch.randn(2, 5, 24, generator=gen) * 3 + 1
    g = torch.randn(2, 5, 24, generator=gen)
    with pytorch_path():
        want = _run(_lean(plain).to(DEVICE), x0.to(DEVICE), g.to(DEVICE))
    forward, backward = _run(_lean(plain).to(DEVICE), x0.to(DEVICE),
                             g.to(DEVICE))
    _assert_same(forward.result[0].cpu(), want[0].result[0].cpu())
    assert backward.triton == ['_frozen_layer_norm_backward']
    assert backward.ops == [], backward.ops
    torch.testing.assert_close(forward.result[1].cpu(),
                               want[0].result[1].cpu(), rtol=1e-5, atol=1e-5)
