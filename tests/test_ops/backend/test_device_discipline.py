"""Device discipline of every autograd Function of ``mmseg_gf.ops`` without
a GPU: forward and backward on fake CUDA tensors (``tests/helpers/
device_discipline.py``) make nothing on the CPU, copy nothing to it and
read no value on the host; their outputs are CUDA tensors of the right
shapes.

A CPU-only build cannot record autograd on fake CUDA tensors, so each
Function's ``forward`` and ``backward`` are called as functions with a
stand-in for autograd's context. The token-grid Functions (the filtered
Linear, the patch-mean GELU) and the transformer blocks' lean ones run
with autograd on the ``meta`` device instead (see
:func:`test_token_functions_on_meta`). The fused classifier + loss computes its
gradient with autograd inside its forward: it runs on the ``meta`` device
with whole training steps instead (``tests/test_engine/
test_device_discipline.py``).
"""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from mmseg_gf.ops.backend import availability
from mmseg_gf.ops.conv import gpu as conv_gpu
from mmseg_gf.ops.conv.function import (GradientFilterConv2dFunction,
                                        conv_geometry)
from mmseg_gf.ops.lean.functions import (FrozenAffineNormFunction,
                                         FrozenConvFunction,
                                         FrozenLinearFunction,
                                         MaskedActivationFunction,
                                         MaskedDropoutFunction,
                                         ShapeOnlyAdaptiveAvgPoolFunction)
from mmseg_gf.ops.lean.activation import (PiecewiseLinearActivationFunction,
                                          hardsigmoid_bits)
from mmseg_gf.ops.lean.pool import (ShapeOnlyAvgPoolFunction,
                                    WindowOffsetMaxPoolFunction)
from mmseg_gf.ops.lean.transformer import (BitMaskDropPathFunction,
                                           FrozenLayerNormFunction,
                                           multihead_attention)
from mmseg_gf.ops.linear.patch_mean_activation import (PatchPartition,
                                                       patch_mean_gelu)
from mmseg_gf.ops.resize.bilinear import BilinearResizeFunction
from tests.helpers.device_discipline import HostSyncError, fake_cuda


class _Context:
    """What autograd hands a Function's ``forward`` and ``backward``."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = tuple(needs_input_grad)
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


def _cuda(*shape):
    return torch.randn(*shape, device='cuda')


def _forward_backward(function, args, needs):
    """``function``'s forward, then its backward of a random output
    gradient; both checked to stay on CUDA. Returns the gradients."""
    ctx = _Context(needs)
    out = function.forward(ctx, *args)
    assert out.device.type == 'cuda', function.__name__
    grads = function.backward(ctx, _cuda(*out.shape))
    for grad, arg, need in zip(grads, args, needs):
        if need and grad is not None:
            assert grad.device.type == 'cuda', function.__name__
            assert grad.shape == arg.shape, function.__name__
    return grads


# (stride, kernel, dilation, groups, radius, size): usual, strided with
# partial patches, dilated taps on the patch grid, depthwise, 1x1.
CONVS = [(1, 3, 1, 1, 4, 16), (2, 3, 1, 1, 2, 13), (1, 3, 8, 1, 2, 24),
         (1, 3, 1, 4, 2, 10), (1, 1, 1, 1, 4, 9)]


@pytest.mark.parametrize('stride,kernel,dilation,groups,radius,size', CONVS)
@pytest.mark.parametrize('path', ['pytorch', 'triton'])
def test_filtered_conv_on_fake_cuda(stride, kernel, dilation, groups, radius,
                                    size, path):
    """The filtered conv's step-by-step backward (every conv kind) and the
    Triton path's Python side (its ops through their fake
    implementations)."""
    if path == 'triton' and not availability.triton_installed():
        pytest.skip('triton is not installed')
    padding = dilation * (kernel // 2)
    with fake_cuda():
        x, w, b = _cuda(2, 4, size, size), _cuda(4, 4 // groups, kernel,
                                                 kernel), _cuda(4)
        args = (x, w, b, (stride, stride), (padding, padding),
                (dilation, dilation), groups, radius)
        if path == 'pytorch':
            _forward_backward(GradientFilterConv2dFunction, args,
                              (True, True, True))
            return
        geo_h, geo_w = conv_geometry(x, w, (stride, stride),
                                     (padding, padding),
                                     (dilation, dilation), radius)
        if not (geo_h.collapsed and geo_w.collapsed):
            pytest.skip('dilated taps: the step-by-step path only')
        assert conv_gpu.usable(x, w, b)
        _forward_backward(
            conv_gpu.TritonFilteredConv2d,
            args + (geo_h.input_patches, geo_w.input_patches),
            (True, True, True))


def test_lean_functions_on_fake_cuda():
    """Frozen norm, activations (bit masks), dropout, pools, frozen conv and
    linear layers, bilinear resize: forward and backward on CUDA."""
    with fake_cuda():
        x = _cuda(2, 4, 9, 11)
        _forward_backward(FrozenAffineNormFunction,
                          (x, _cuda(4), lambda t: t * 2.0),
                          (True, False, False))
        _forward_backward(MaskedActivationFunction,
                          (x, F.relu, 0.0, None, True, 0.0, False),
                          (True, ) + (False, ) * 6)
        _forward_backward(MaskedActivationFunction,
                          (x, lambda t: F.leaky_relu(t, 0.1), 0.0, None,
                           False, 0.1, False), (True, ) + (False, ) * 6)
        _forward_backward(PiecewiseLinearActivationFunction,
                          (x, F.hardsigmoid, hardsigmoid_bits, None, None,
                           False), (True, ) + (False, ) * 5)
        _forward_backward(MaskedDropoutFunction, (x, 0.3), (True, False))
        _forward_backward(WindowOffsetMaxPoolFunction,
                          (x, (3, 3), (2, 2), (1, 1), (1, 1), True),
                          (True, ) + (False, ) * 5)
        _forward_backward(ShapeOnlyAvgPoolFunction,
                          (x, (2, 2), (2, 2), (0, 0), True, True, None),
                          (True, ) + (False, ) * 6)
        _forward_backward(ShapeOnlyAdaptiveAvgPoolFunction,
                          (x, lambda t: F.adaptive_avg_pool2d(t, 3)),
                          (True, False))
        weight = _cuda(6, 4, 3, 3)
        _forward_backward(FrozenConvFunction,
                          (x, weight, lambda t: F.conv2d(t, weight, None, 2,
                                                         1), (2, 2), (1, 1),
                           (1, 1), 1), (True, ) + (False, ) * 6)
        linear = _cuda(5, 11)
        _forward_backward(FrozenLinearFunction,
                          (x, linear, lambda t: F.linear(t, linear)),
                          (True, False, False))
        _forward_backward(BilinearResizeFunction,
                          (x, (17, 23), None, False, None),
                          (True, False, False, False, False))


def test_the_checks_catch_what_they_are_for():
    """A CPU tensor mixed in, a value read and a copy to the host each
    fail under :func:`fake_cuda` (the test above would otherwise prove
    nothing)."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               FakeTensorDeviceMismatchError)
    with fake_cuda():
        x = _cuda(3)
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.ones(3)
        with pytest.raises((DataDependentOutputException, HostSyncError)):
            x.sum().item()
        with pytest.raises(HostSyncError):
            x.cpu()
        with pytest.raises(HostSyncError):
            torch.masked_select(x, x > 0)


# (grid, input shape, token_dim): tokens with a cls token and partial
# patches, (N, B, C), 'hwc', Swin's windows, trailing tokens.
TOKEN_CASES = [
    (TokenGrid(5, 7, extra_tokens=1), (2, 36, 6), 1),
    (TokenGrid(4, 4, extra_tokens=1), (17, 2, 6), 0),
    (TokenGrid(6, 5, layout='hwc'), (2, 6, 5, 6), 1),
    (TokenGrid.windows(4), (6, 16, 6), 1),
    (TokenGrid(3, 4, trailing_tokens=3), (2, 15, 6), 1),
]


def _meta(*shape, grad=True):
    return torch.randn(*shape, device='meta', requires_grad=grad)


def _backward_on_meta(out, leaves):
    """Autograd's backward of ``out`` on the ``meta`` device (a CPU tensor
    mixed in, a value read or a copy to the host fails there); every
    leaf's gradient a meta tensor of its shape."""
    assert out.device.type == 'meta'
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    for grad, leaf in zip(grads, leaves):
        assert grad.device.type == 'meta' and grad.shape == leaf.shape


@pytest.mark.parametrize('grid,shape,token_dim', TOKEN_CASES)
def test_token_functions_on_meta(grid, shape, token_dim):
    """The filtered Linear (trained and frozen weight) and the patch-mean
    GELU on a token grid, forward and backward through autograd on the
    ``meta`` device: fake CUDA tensors cannot run their Python-side
    indexing (``Tensor.__getitem__`` and ``contiguous`` need the CUDA
    runtime in a CPU-only build), meta tensors can."""
    x = _meta(*shape)
    weight, bias = _meta(4, shape[-1]), _meta(4)
    _backward_on_meta(gradient_filtered_linear(x, weight, bias, grid, 2,
                                               token_dim), [x, weight, bias])
    frozen = _meta(4, shape[-1], grad=False)
    _backward_on_meta(gradient_filtered_linear(x, frozen, None, grid, 3,
                                               token_dim), [x])
    if grid.layout != 'windows':
        part = PatchPartition.tokens(grid, 2,
                                     grid.token_axis(shape, token_dim))
        _backward_on_meta(patch_mean_gelu(x, 'none', part), [x])


def test_transformer_functions_on_meta():
    """The patch-mean GELU on a conv map, the frozen LayerNorm, the
    bit-mask DropPath and the frozen attention through SDPA."""
    x = _meta(2, 4, 9, 11)
    _backward_on_meta(patch_mean_gelu(x, 'tanh',
                                      PatchPartition.conv_map(4, 9, 11)),
                      [x])
    tokens = _meta(2, 12, 8)
    _backward_on_meta(FrozenLayerNormFunction.apply(
        tokens, (8, ), _meta(8, grad=False), _meta(8, grad=False), 1e-6),
        [tokens])
    _backward_on_meta(BitMaskDropPathFunction.apply(tokens, 0.3), [tokens])
    proj = [(_meta(8, 8, grad=False), _meta(8, grad=False))
            for _ in range(4)]
    _backward_on_meta(multihead_attention(tokens, tokens, tokens, 2,
                                          proj[0], None, proj[1], proj[2],
                                          proj[3]), [tokens])


def test_meta_catches_a_cpu_tensor_and_a_value_read():
    """The meta checks above would otherwise prove nothing."""
    x = _meta(3)
    with pytest.raises(RuntimeError):
        x + torch.ones(3)
    with pytest.raises(RuntimeError):
        x.sum().item()
