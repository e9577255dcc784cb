"""The cost model against hand-computed counts and the op's saved tensors."""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops.conv.cost import conv_backward_cost
from mmseg_gf.ops import gradient_filtered_conv2d


def test_plain_3x3_counts():
    c = conv_backward_cost(8, 16, 3, 3, 1, 1, 1, (32, 32), (32, 32),
                           batch=2, radius=4, need_input_grad=True)
    dense = 2 * 2 * 16 * 32 * 32 * 8 * 9  # 4,718,592
    assert c.vanilla_grad_input_flops == c.vanilla_grad_weight_flops == dense
    assert c.vanilla_flops == 9437184
    # 8x8 patches, collapsed kernel: 2*N*Co*Ci*P
    assert c.gf_grad_input_flops == c.gf_grad_weight_flops == 32768
    # g_y patch means (N*Co*Ho*Wo) + kernel tap sums (Co*Ci*k*k)
    assert c.gf_overhead_flops == 32768 + 1152
    assert c.gf_flops == 2 * 32768 + 33920
    assert c.vanilla_saved_bytes == 2 * 8 * 32 * 32 * 4 == 65536
    assert c.gf_saved_bytes == 2 * 8 * 64 * 4 == 4096
    # forward-side patch sums of x: one add per covered input pixel
    assert c.gf_forward_overhead_flops == 2 * 8 * 32 * 32


def test_strided_first_layer_no_input_grad():
    c = conv_backward_cost(4, 4, 3, 3, 2, 1, 1, (16, 16), (8, 8), batch=1,
                           radius=2, need_input_grad=False)
    assert c.vanilla_grad_input_flops == c.gf_grad_input_flops == 0
    assert c.vanilla_grad_weight_flops == 2 * 4 * 64 * 4 * 9 == 18432
    assert c.gf_grad_weight_flops == 2 * 4 * 4 * 16 == 512
    assert c.gf_overhead_flops == 4 * 64  # no tap sum: only g_W, collapsed
    assert c.vanilla_saved_bytes == 4 * 16 * 16 * 4
    assert c.gf_saved_bytes == 4 * 16 * 4
    assert c.gf_forward_overhead_flops == 4 * 16 * 16


def test_dilated_keeps_taps_and_partial_patches():
    # d=12, r=4: pooled dilation 3, taps kept on the pooled grid
    c = conv_backward_cost(8, 8, 3, 3, 1, 12, 1, (8, 8), (8, 8), batch=1,
                           radius=4, need_input_grad=True)
    assert c.gf_grad_input_flops == 2 * 8 * 8 * 4 * 9 == 4608
    assert c.vanilla_grad_input_flops == 2 * 8 * 64 * 8 * 9
    assert c.gf_overhead_flops == 8 * 64 + 8 * 8 * 9
    # d=2 < r: collapsed
    c2 = conv_backward_cost(8, 8, 3, 3, 1, 2, 1, (8, 8), (8, 8), batch=1,
                            radius=4, need_input_grad=True)
    assert c2.gf_grad_input_flops == 2 * 8 * 8 * 4
    # 7x7 output, r=4: ceil -> 2x2 patches
    c3 = conv_backward_cost(2, 2, 1, 1, 1, 1, 1, (7, 7), (7, 7), batch=1,
                            radius=4, need_input_grad=False)
    assert c3.gf_grad_weight_flops == 2 * 2 * 2 * 4
    assert c3.gf_saved_bytes == 2 * 4 * 4
    # patches cover 8x8 input pixels (zero-padded past the 7x7 map)
    assert c3.gf_forward_overhead_flops == 2 * 8 * 8


def test_depthwise_and_frozen_weight():
    c = conv_backward_cost(8, 8, 3, 3, (1, 1), (1, 1), 8, (16, 16), (16, 16),
                           batch=2, radius=4, need_input_grad=True,
                           need_weight_grad=False, elem_bytes=2)
    assert c.vanilla_grad_input_flops == 2 * 2 * 8 * 256 * 1 * 9
    assert c.vanilla_grad_weight_flops == c.gf_grad_weight_flops == 0
    assert c.gf_grad_input_flops == 2 * 2 * 8 * 1 * 16
    assert c.vanilla_saved_bytes == c.gf_saved_bytes == 0
    assert c.gf_forward_overhead_flops == 0


def _saved_activation_bytes(fn, x, w):
    """Bytes autograd saves for ``fn(x, w)``, the weight itself excluded."""
    total = [0]

    def pack(t):
        if t.data_ptr() != w.data_ptr():
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w)
    return total[0]


@pytest.mark.parametrize('stride, radius', [(1, 4), (2, 2)])
def test_saved_bytes_match_the_op(stride, radius):
    x = torch.randn(2, 6, 16, 16, requires_grad=True)
    w = torch.randn(5, 6, 3, 3, requires_grad=True)
    out_hw = F.conv2d(x, w, stride=stride, padding=1).shape[2:]
    cost = conv_backward_cost(6, 5, 3, 3, stride, 1, 1, (16, 16), out_hw,
                              batch=2, radius=radius, need_input_grad=True)
    gf = _saved_activation_bytes(
        lambda a, b: gradient_filtered_conv2d(
            a, b, stride=stride, padding=1, radius=radius), x, w)
    vanilla = _saved_activation_bytes(
        lambda a, b: F.conv2d(a, b, stride=stride, padding=1), x, w)
    assert gf == cost.gf_saved_bytes
    assert vanilla == cost.vanilla_saved_bytes
