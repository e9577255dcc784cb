"""Frozen convs and linear layers in the gradient path keep nothing.

A frozen conv (or linear layer) whose input needs a gradient computes
``g_x`` from its weight alone. The lean variants (:mod:`mmseg_gf.models.lean`,
kinds ``frozen_conv`` / ``frozen_linear``) are checked against the plain
torch modules (autograd's own formulas): the same output bit for bit, the
same input gradient, nothing kept for backward. ``g_x`` of the conv is also
checked against an independent formula, the transposed convolution with the
``output_padding`` that restores the input size.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.models.gf_conv import GFConv2d, is_filterable_conv
from mmseg_gf.models.lean import (frozen_conv_is_lean, is_lean, lean_kind,
                                  make_lean, make_plain)
from tests.helpers.devices import needs_token_kinds
from tests.helpers.frozen_modules import frozen_random

# (in, out, kernel, stride, padding, dilation, groups, H, W, bias)
CONV_CASES = [
    (4, 6, 3, 1, 1, 1, 1, 9, 9, True),
    (4, 6, 3, 2, 1, 1, 1, 9, 9, False),  # stride divides H + 2p - k
    (4, 6, 3, 2, 1, 1, 1, 10, 11, True),  # output_padding 1
    (4, 6, 3, 3, 0, 1, 1, 13, 14, True),  # output_padding 1 and 2
    (4, 4, 3, 1, 2, 2, 1, 7, 8, True),  # dilated
    (4, 8, 3, 2, 2, 2, 2, 11, 10, True),  # dilated, strided, groups
    (6, 6, 3, 2, 1, 1, 6, 9, 12, True),  # depthwise
    (6, 12, 5, 2, 2, 1, 3, 15, 13, False),
    (4, 6, 1, 1, 0, 1, 1, 5, 7, True),  # 1x1
    (4, 6, 1, 2, 0, 1, 1, 5, 7, True),  # strided 1x1: rows left unread
    (4, 6, (3, 1), (2, 1), (1, 0), 1, 1, 9, 6, True),  # asymmetric
    (4, 6, (1, 5), (1, 3), (0, 4), (1, 2), 2, 6, 17, True),
    (3, 5, 4, 2, 1, 1, 1, 8, 9, True),  # even kernel
]


def _run(module: nn.Module, x0: torch.Tensor, grad: torch.Tensor):
    """Output, input gradient and bytes kept for backward of one call."""
    x = x0.clone().requires_grad_(True)
    kept = saved_tensor_bytes(lambda: module(x * 1.0))
    out = module(x * 1.0)
    out.backward(grad)
    return out.detach(), x.grad, kept


def _compare(plain: nn.Module, x0: torch.Tensor):
    lean = copy.deepcopy(plain)
    make_lean(lean)
    assert is_lean(lean)
    grad = torch.randn_like(plain(x0))
    want, got = _run(plain, x0, grad), _run(lean, x0, grad)
    assert torch.equal(got[0], want[0]), 'forward differs'
    scale = float(want[1].abs().max()) if want[1].numel() else 0.0
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6 * scale)
    return want, got


def _transposed_reference(conv: nn.Conv2d, grad: torch.Tensor, size):
    """``g_x`` as the transposed convolution of ``g`` (float64), with the
    output padding that gives back the input size."""
    extra = []
    for i in range(2):
        span = conv.dilation[i] * (conv.kernel_size[i] - 1) + 1
        covered = (grad.shape[2 + i] - 1) * conv.stride[i] + span
        extra.append(size[i] + 2 * conv.padding[i] - covered)
    return F.conv_transpose2d(grad.double(), conv.weight.double(),
                              stride=conv.stride, padding=conv.padding,
                              output_padding=extra, groups=conv.groups,
                              dilation=conv.dilation)


@pytest.mark.parametrize('case', CONV_CASES)
def test_frozen_conv_equals_plain_and_keeps_nothing(case):
    cin, cout, k, s, p, d, g, h, w, bias = case
    conv = frozen_random(nn.Conv2d(cin, cout, k, s, p, d, g, bias=bias))
    x0 = torch.randn(2, cin, h, w)
    want, got = _compare(conv, x0)
    assert want[2] == x0.numel() * 4  # autograd keeps the input
    assert got[2] == 0
    grad = torch.randn_like(want[0])
    lean = copy.deepcopy(conv)
    make_lean(lean)
    _, g_x, _ = _run(lean, x0, grad)
    torch.testing.assert_close(g_x.double(),
                               _transposed_reference(conv, grad, (h, w)),
                               rtol=1e-5, atol=1e-5)


def test_frozen_conv_channels_last():
    conv = frozen_random(nn.Conv2d(8, 8, 3, 2, 1)).to(
        memory_format=torch.channels_last)
    x0 = torch.randn(2, 8, 9, 10).to(memory_format=torch.channels_last)
    _, got = _compare(conv, x0)
    assert got[2] == 0


def test_frozen_conv_under_cpu_autocast():
    conv = frozen_random(nn.Conv2d(4, 6, 3, 2, 1))
    lean = copy.deepcopy(conv)
    make_lean(lean)
    x0 = torch.randn(2, 4, 9, 9)
    results = []
    for module in (conv, lean):
        x = x0.clone().requires_grad_(True)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = module(x * 1.0)
        out.float().sum().backward()
        results.append((out, x.grad))
    (want, want_g), (got, got_g) = results
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert got_g.dtype == torch.float32
    assert torch.equal(got_g, want_g)  # the same bfloat16 kernel, then cast


@pytest.mark.parametrize('shape', [(5, 8), (2, 3, 8), (2, 0, 8)])
@pytest.mark.parametrize('bias', [True, False])
@needs_token_kinds
def test_frozen_linear_equals_plain_and_keeps_nothing(shape, bias):
    linear = frozen_random(nn.Linear(8, 6, bias=bias))
    x0 = torch.randn(shape)
    want, got = _compare(linear, x0)
    # autograd keeps the weight's transposed view only (the Parameter's
    # storage, counted here as it is not the Parameter object itself)
    assert want[2] in (0, linear.weight.numel() * 4)
    assert got[2] == 0


@pytest.mark.parametrize('make', [
    lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode='reflect'),
    lambda: nn.Conv2d(4, 6, 3, padding='same'),
])
def test_other_padding_runs_the_plain_conv(make):
    conv = frozen_random(make())
    lean = copy.deepcopy(conv)
    make_lean(lean)
    assert lean_kind(lean) == 'frozen_conv' and not frozen_conv_is_lean(lean)
    want, got = _compare(conv, torch.randn(2, 4, 7, 8))
    assert got[2] == want[2] > 0


def test_trained_layers_run_the_plain_path():
    for plain, x0 in ((nn.Conv2d(4, 6, 3, 2, 1), torch.randn(2, 4, 9, 9)),
                      (nn.Linear(8, 6), torch.randn(5, 8))):
        frozen_random(plain).weight.requires_grad_(True)
        lean = copy.deepcopy(plain)
        make_lean(lean)
        grad = torch.randn_like(plain(x0))
        want, got = _run(plain, x0, grad), _run(lean, x0, grad)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])
        assert got[2] == want[2] > 0
        assert torch.equal(lean.weight.grad, plain.weight.grad)


def test_kinds_and_classes():
    conv, gf = nn.Conv2d(2, 2, 3), GFConv2d(2, 2, 3, radius=2)
    assert lean_kind(conv) == 'frozen_conv' and lean_kind(gf) is None
    assert lean_kind(nn.ConvTranspose2d(2, 2, 3)) is None
    assert lean_kind(nn.Conv1d(2, 2, 3)) is None
    lean = copy.deepcopy(conv)
    assert make_lean(lean) == 'frozen_conv'
    assert lean_kind(lean) == 'frozen_conv'
    assert isinstance(lean, nn.Conv2d) and is_filterable_conv(lean)
    swapped = GFConv2d.from_conv(lean, radius=2)
    assert swapped.weight is lean.weight
    assert make_plain(lean) and type(lean) is nn.Conv2d


@needs_token_kinds
def test_linear_kind_and_class():
    assert lean_kind(nn.Linear(2, 2)) == 'frozen_linear'
    linear = nn.Linear(2, 2)
    make_lean(linear)
    assert lean_kind(linear) == 'frozen_linear'


def test_mmcv_layers_are_lean_kinds():
    wrappers = pytest.importorskip('mmcv.cnn.bricks.wrappers')
    assert lean_kind(wrappers.Conv2d(2, 2, 3)) == 'frozen_conv'
    assert lean_kind(wrappers.Linear(2, 2)) == 'frozen_linear'
    conv = frozen_random(wrappers.Conv2d(4, 6, 3, 2, 1))
    _, got = _compare(conv, torch.randn(2, 4, 9, 9))
    assert got[2] == 0


def _chain():
    """conv with a trained bias (the optimizer updates what the backward
    does not read) -> frozen conv -> frozen linear on channels."""
    trained = frozen_random(nn.Conv2d(3, 4, 3, padding=1))
    trained.bias.requires_grad_(True)
    frozen = frozen_random(nn.Conv2d(4, 4, 3, 2, 1))
    head = frozen_random(nn.Linear(4, 2))
    return nn.ModuleList([trained, frozen, head])


def _chain_loss(chain, x):
    y = chain[1](chain[0](x))
    return chain[2](y.mean((2, 3))).square().sum()


def test_optimizer_steps_between_forward_and_backward():
    """An optimizer over every parameter (momentum, weight decay) steps
    while a lean graph is alive (gradient accumulation over two forwards):
    the frozen weights get no gradient, are never updated, and the
    backward of the older graph still runs, with the plain gradients."""
    x = torch.randn(2, 3, 9, 9)
    results = []
    for lean in (False, True):
        chain = _chain()
        if lean:
            for m in chain:
                make_lean(m)
        opt = torch.optim.SGD(chain.parameters(), lr=0.1, momentum=0.9,
                              weight_decay=1e-2)
        first = _chain_loss(chain, x)
        second = _chain_loss(chain, x.flip(-1))
        first.backward()
        opt.step()
        second.backward()
        results.append(chain[0].bias.grad.clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=0)


def test_in_place_change_of_a_frozen_weight_is_an_error():
    """As autograd's saved tensors: a frozen weight modified between
    forward and backward fails the backward (plain and lean alike)."""
    for lean in (False, True):
        chain = _chain()
        if lean:
            for m in chain:
                make_lean(m)
        for index in (1, 2):
            loss = _chain_loss(chain, torch.randn(2, 3, 9, 9))
            with torch.no_grad():
                chain[index].weight.mul_(1.0)
            with pytest.raises(RuntimeError, match='modified'):
                loss.backward()
