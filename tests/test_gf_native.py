"""The compiled CPU kernels against the pure-PyTorch path.

Both paths must give the same numbers for every geometry (padding before
the map, patches running past it, strides, partial patches); the reference
tests in test_gf_op.py run with whichever path is active.
"""
import itertools

import pytest
import torch

from mmseg_gf.ops import gradient_filtered_conv2d, native
from mmseg_gf.ops.gradient_filter import (AxisGeometry, filter_output_grad,
                                          pool_input_patches, spread_to_input)

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason='compiled kernels not built (pip install --no-build-isolation -e .)')


def _out_sizes(size, k, s, p, d):
    return [(v + 2 * p - d * (k - 1) - 1) // s + 1 for v in size]


# stride, kernel, padding, dilation, radius, input size (non-empty outputs)
CASES = [
    case for case in itertools.product((1, 2), (1, 3, 5), (0, 1, 3), (1, 2, 5),
                                       (2, 3, 4), ((7, 9), (13, 11), (2, 1)))
    if min(_out_sizes(case[5], *case[1:2], case[0], *case[2:4])) >= 1
]


@pytest.mark.parametrize('s,k,p,d,r,size', CASES)
def test_pooling_and_spread_match_pure_torch(monkeypatch, s, k, p, d, r,
                                             size):
    geo_h, geo_w = (
        AxisGeometry.of(v, o, k, s, p, d, r)
        for v, o in zip(size, _out_sizes(size, k, s, p, d)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 3, geo_h.out_size, geo_w.out_size, generator=gen,
                    dtype=torch.float64)
    grid = torch.randn(2, 3, geo_h.num_patches, geo_w.num_patches,
                       generator=gen, dtype=torch.float64)
    fast = (pool_input_patches(x, geo_h, geo_w),
            filter_output_grad(g, geo_h, geo_w, torch.float64),
            spread_to_input(grid, geo_h, geo_w))
    monkeypatch.setenv('MMSEG_GF_NATIVE', '0')
    slow = (pool_input_patches(x, geo_h, geo_w),
            filter_output_grad(g, geo_h, geo_w, torch.float64),
            spread_to_input(grid, geo_h, geo_w))
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast[1], slow[1], rtol=1e-12, atol=1e-12)
    assert torch.equal(fast[2], slow[2])
    assert fast[2].shape == x.shape


def test_whole_operator_float32_matches_pure_torch(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 30, 41, generator=gen)
    w = torch.randn(6, 8, 3, 3, generator=gen)
    b = torch.randn(6, generator=gen)
    g = torch.randn(2, 6, 15, 21, generator=gen)

    def grads():
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        gradient_filtered_conv2d(xs, ws, bs, 2, 1, 1, 1, 4).backward(g)
        return xs.grad, ws.grad, bs.grad

    fast = grads()
    monkeypatch.setenv('MMSEG_GF_NATIVE', '0')
    slow = grads()
    for a, b_ in zip(fast, slow):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_unsupported_inputs_use_the_pure_path():
    """bf16, channels_last and non-CPU tensors are not for the kernels."""
    t = torch.randn(1, 2, 4, 4)
    assert native.usable(t)
    assert not native.usable(t.bfloat16())
    assert not native.usable(t.contiguous(memory_format=torch.channels_last))
    assert not native.usable(t.transpose(2, 3))
