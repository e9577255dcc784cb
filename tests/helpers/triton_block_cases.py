"""Cases of the fused conv block (``mmseg_gf.models.conv_block``,
``mmseg_gf.ops.conv_block.gpu``); run by
``tests/test_models/test_conv_block.py`` in a subprocess (interpreted on
CPU tensors, compiled on CUDA), for the reason
``tests/helpers/triton_cases.py`` gives.

Each case builds an mmcv ``ConvModule`` (a filtered conv, a frozen batch
norm, an activation), makes it lean and compares the fused node with the
same block running its three lean modules (``MMSEG_GF_CONV_BLOCKS=0``)
and with the plain block's forward: the fused launch normalizes in its own
float32 order, so the outputs agree to float32 rounding (:data:`FORWARD`).
"""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip('mmcv')

from mmcv.cnn import ConvModule  # noqa: E402

from mmseg_gf.accounting.launches import LaunchCounter, counting  # noqa: E402
from mmseg_gf.engine.lean_region import apply_lean_region  # noqa: E402
from mmseg_gf.models import GFConv2d  # noqa: E402
from mmseg_gf.ops.backend import switches
from mmseg_gf.ops.conv_block import gpu as triton_conv_block  # noqa: E402
from tests.helpers.triton_runs import case_device  # noqa: E402

DEVICE = case_device()

ACTS = {'relu': dict(type='ReLU'), 'relu6': dict(type='ReLU6'),
        'leaky': dict(type='LeakyReLU', negative_slope=0.1)}


def _block(act='relu', kernel=3, stride=1, groups=1, bias=False,
           channels=(6, 8), affine=True, seed=0):
    """A lean ConvModule on DEVICE whose conv is filtered (r = 2), its norm
    frozen in eval mode with non-trivial statistics."""
    torch.manual_seed(seed)
    ci, co = channels
    block = ConvModule(ci, co, kernel, stride=stride, padding=kernel // 2,
                       groups=groups, bias=bias,
                       norm_cfg=dict(type='BN', affine=affine),
                       act_cfg=ACTS[act])
    block.conv = GFConv2d.from_conv(block.conv, radius=2)
    bn = block.norm
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    if affine:
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.2, 0.2)
        bn.weight.requires_grad_(False)
        bn.bias.requires_grad_(False)
    block.eval()
    apply_lean_region(block)
    return block.to(DEVICE)


def _run(block, x, g, fused: bool):
    """Output and gradients (x, weight[, bias]) of one call, the block
    fused or not; and whether it ran fused."""
    leaf = x.clone().to(DEVICE).requires_grad_(True)
    calls = triton_conv_block.block_calls()
    with switches.override(MMSEG_GF_CONV_BLOCKS=fused):
        out = block(leaf)
    ran = triton_conv_block.block_calls() - calls
    params = [p for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [leaf, *params], g.to(DEVICE))
    return out.detach().cpu(), [t.cpu() for t in grads], ran


#: The fused forward against the modules' (float32): a few units in the
#: last place of the norm's output, which is O(1) here.
FORWARD = dict(rtol=1e-6, atol=1e-6)


def _compare_with_modules(block, x, g, fused: int = 1):
    """One call of ``block`` on ``x`` (backward from ``g``), fused and with
    its modules: ``fused`` fused nodes ran (none with the switch off), the
    outputs equal to float32 rounding (:data:`FORWARD`), the gradients the
    modules' (:func:`_assert_close_grads`). Returns the fused output."""
    want_out, want, ran_plain = _run(block, x, g, fused=False)
    got_out, got, ran = _run(block, x, g, fused=True)
    assert (ran_plain, ran) == (0, fused)
    torch.testing.assert_close(got_out, want_out, **FORWARD)
    _assert_close_grads(got, want)
    return got_out


def _check_fused_against_modules(block, shape, seed: int, fused: int):
    """:func:`_compare_with_modules` on a random input, the output also
    the plain forward's to float32 rounding."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    with torch.no_grad():
        y = block(x.to(DEVICE))
    g = torch.randn(y.shape, generator=gen)
    got_out = _compare_with_modules(block, x, g, fused)
    torch.testing.assert_close(got_out, y.cpu(), **FORWARD)  # plain forward


def _assert_close_grads(got, want):
    """float32: the same operations up to the order of the patch sums."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5,
                                   atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize('act', sorted(ACTS))
@pytest.mark.parametrize('kernel,stride,groups,bias', [
    (3, 1, 1, False), (1, 2, 1, True), (3, 2, 6, False)])
def test_fused_block_equals_its_three_modules(act, kernel, stride, groups,
                                              bias):
    """ReLU, ReLU6, LeakyReLU after a dense or depthwise conv (3x3 and
    1x1, strides 1 and 2, with and without bias): the fused node gives the
    three lean modules' output to float32 rounding and their gradients
    (float32: the same operations up to the order of the patch sums)."""
    block = _block(act, kernel, stride, groups, bias,
                   channels=(6, 6 if groups > 1 else 8))
    _check_fused_against_modules(block, (2, 6, 9, 11), seed=1, fused=1)


def test_non_affine_norm_and_channels_last():
    """A norm without weight (factor ``rsqrt(var + eps)``) and a
    channels-last input: the mask read at the output's strides."""
    block = _block(affine=False).to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 8, 10, generator=gen).contiguous(
        memory_format=torch.channels_last)
    g = torch.randn(2, 8, 8, 10, generator=gen)
    _compare_with_modules(block, x, g)


def test_an_input_without_gradient_runs_fused():
    """The first trained block of a model: its input needs no gradient, its
    conv's parameters do. It runs fused, with the modules' output to
    float32 rounding and their weight and bias gradients."""
    block = _block(bias=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 9, 11, generator=gen).to(DEVICE)
    g = torch.randn(2, 8, 9, 11, generator=gen).to(DEVICE)
    params = [p for p in block.parameters() if p.requires_grad]
    assert len(params) == 2  # the conv's weight and bias
    results = []
    for fused in (False, True):
        calls = triton_conv_block.block_calls()
        with switches.override(MMSEG_GF_CONV_BLOCKS=fused):
            out = block(x)
        ran = triton_conv_block.block_calls() - calls
        grads = torch.autograd.grad(out, params, g)
        results.append((out.detach().cpu(), [t.cpu() for t in grads], ran))
    (want_out, want, ran_plain), (got_out, got, ran) = results
    assert (ran_plain, ran) == (0, 1)
    torch.testing.assert_close(got_out, want_out, **FORWARD)
    _assert_close_grads(got, want)


def test_two_launches_forward_and_backward():
    """The fused block's forward: cuDNN's conv and one launch (norm,
    activation, mask, the input's patch sums); its backward: the pass over
    the gradient (mask and factor included, the taps' sums), both
    products; nothing else."""
    block = _block()
    x = torch.randn(2, 6, 8, 8).to(DEVICE).requires_grad_(True)
    counter = LaunchCounter()
    with counting(counter):
        out = block(x)
    assert counter.result.by_op() == {'aten.convolution.default': 1,
                                      'triton:_block_forward': 1}
    g = torch.ones_like(out)
    counter = LaunchCounter()
    counter.phase('backward')
    with counting(counter):
        torch.autograd.grad(out, [x, block.conv.weight], g)
    assert counter.result.by_op() == {'triton:_patch_reduce': 1,
                                      'triton:_products': 1}


def test_forward_against_an_independent_norm():
    """The fused forward against the norm and ReLU computed in float64
    from the conv's output: ``relu((y - mean) / sqrt(var + eps) * w +
    b)``, to float32 rounding."""
    block = _block(bias=True)
    x = torch.randn(2, 6, 8, 10).to(DEVICE)
    with torch.no_grad():
        y = block.conv(x).double().cpu()
    bn = block.norm
    stats = [t.detach().double().cpu().view(1, -1, 1, 1) for t in
             (bn.running_mean, bn.running_var, bn.weight, bn.bias)]
    mean, var, weight, bias = stats
    want = torch.relu((y - mean) / torch.sqrt(var + bn.eps) * weight + bias)
    got, _, ran = _run(block, x.cpu(), torch.ones(want.shape), fused=True)
    assert ran == 1
    torch.testing.assert_close(got.double(), want, **FORWARD)


def test_what_runs_the_modules():
    """A hook on a part, a trained norm, an unfiltered conv or the switch
    off: mmcv's forward, the three modules."""
    x = torch.randn(1, 6, 8, 8).to(DEVICE).requires_grad_(True)

    def fused(block):
        calls = triton_conv_block.block_calls()
        block(x)
        return triton_conv_block.block_calls() - calls

    block = _block()
    assert fused(block) == 1
    handle = block.activate.register_forward_hook(lambda *a: None)
    assert fused(block) == 0
    handle.remove()
    trained = copy.deepcopy(block)
    trained.norm.weight.requires_grad_(True)
    assert fused(trained) == 0
    unfiltered = copy.deepcopy(block)
    unfiltered.conv.enabled = False
    assert fused(unfiltered) == 0
    with switches.override(MMSEG_GF_CONV_BLOCKS=False):
        assert fused(block) == 0
    with torch.no_grad():
        assert fused(block) == 0


def _resnet_block(kind: str, stride: int):
    """mmseg's ResNet block (with a downsampling conv where the stride or
    the channels change), every conv filtered (r = 2), every norm frozen."""
    from mmseg.models.backbones.resnet import BasicBlock, Bottleneck
    torch.manual_seed(0)
    cls, planes = (BasicBlock, 6) if kind == 'basic' else (Bottleneck, 2)
    out = planes * cls.expansion
    downsample = nn.Sequential(nn.Conv2d(6, out, 1, stride, bias=False),
                               nn.BatchNorm2d(out)) if stride > 1 or \
        out != 6 else None
    block = cls(6, planes, stride=stride, downsample=downsample)
    for name, module in list(block.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Conv2d:
                setattr(module, child_name,
                        GFConv2d.from_conv(child, radius=2))
            if isinstance(child, nn.BatchNorm2d):
                child.running_var.uniform_(0.5, 2.0)
                child.running_mean.uniform_(-0.5, 0.5)
                child.weight.requires_grad_(False)
                child.bias.requires_grad_(False)
    block.eval()
    apply_lean_region(block)
    return block.to(DEVICE)


@pytest.mark.parametrize('kind,stride,fused', [('basic', 1, 1),
                                               ('basic', 2, 1),
                                               ('bottleneck', 2, 2)])
def test_resnet_blocks_equal_their_modules(kind, stride, fused):
    """mmseg's BasicBlock (its first conv, norm, ReLU fused) and Bottleneck
    (its first two): the output of mmseg's forward bit for bit, its
    gradients (the switch off: every module on its own)."""
    block = _resnet_block(kind, stride)
    _check_fused_against_modules(block, (2, 6, 9, 10), seed=3, fused=fused)


def test_frozen_conv_weight_keeps_no_patch_sums():
    """A block whose conv weight is frozen (only ``g_x`` needed): the
    forward launch writes no patch sums, the output and ``g_x`` are the
    modules'."""
    block = _block(bias=True)
    block.conv.weight.requires_grad_(False)
    block.conv.bias.requires_grad_(False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 9, 11, generator=gen)
    g = torch.randn(2, 8, 9, 11, generator=gen)
    _compare_with_modules(block, x, g)
