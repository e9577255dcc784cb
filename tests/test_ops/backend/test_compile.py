"""``torch.compile`` of the operators: every lean module and the filtered
conv trace with no graph break (``fullgraph=True``) and give eager mode's
outputs and gradients; the registered operators (``torch.library``) pass
``opcheck``.

``aot_eager`` (Dynamo's graph and AOTAutograd's forward / backward split,
run without code generation): what these tests check is the tracing;
Inductor's C++ code generation is checked once, at model level
(``tests/test_engine/test_compile_step.py``).
"""
import pytest
import torch
from torch import nn

from mmseg_gf.models.gf_conv import GFConv2d
from mmseg_gf.models.lean import is_lean, make_lean
from mmseg_gf.ops import (TokenGrid, gradient_filtered_conv2d,
                          gradient_filtered_linear)
from mmseg_gf.ops.bit_mask import masks as bit_mask
from mmseg_gf.ops.backend import availability
from mmseg_gf.ops.conv import cpu as conv_cpu
from mmseg_gf.ops.resized_loss import loss as resized_loss
from mmseg_gf.ops.resized_loss import traced as traced_loss
from mmseg_gf.ops.resize.bilinear import strided_gradient_resizes
from tests.helpers.devices import needs_token_kinds

KERNELS = pytest.mark.skipif(not availability.native_available(),
                             reason='compiled CPU kernels not built')
LOSS_KERNEL = pytest.mark.skipif(
    not resized_loss.operator_usable(torch.zeros(1)),
    reason='compiled resized-loss kernel not built')


def _lean(*modules: nn.Module) -> nn.Sequential:
    chain = nn.Sequential(*modules)
    for m in chain:
        make_lean(m)
    return chain


def _frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False)


def _cnn_chain() -> nn.Sequential:
    """A frozen conv, norm, in-place ReLU, max pool, dropout, pyramid pool
    and LeakyReLU: every CNN lean kind, each of them lean."""
    torch.manual_seed(0)
    norm = _frozen(nn.BatchNorm2d(4)).eval()
    norm.running_var.uniform_(0.5, 2.0)
    return _lean(_frozen(nn.Conv2d(3, 4, 3, padding=1)), norm,
                 nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
                 nn.Dropout(0.3), nn.AdaptiveAvgPool2d(3),
                 nn.LeakyReLU(0.1), nn.ReLU6())


def _token_chain() -> nn.Sequential:
    """A frozen LayerNorm and Linear, GELU (torch's: no lean kind) and
    dropout on tokens."""
    torch.manual_seed(0)
    return _lean(_frozen(nn.LayerNorm(6)), _frozen(nn.Linear(6, 5)),
                 nn.GELU(), nn.Dropout(0.2), _frozen(nn.Linear(5, 4)))


def _step(fn, x: torch.Tensor, params=()):
    """``fn(x)`` and the gradients of a weighted sum of it w.r.t. ``x`` and
    ``params``, with the random draws seeded (``aot_eager`` draws what
    eager draws)."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(3)
    out = fn(x)
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), [x, *params])
    return (out.detach(), *grads)


def _check_compiled(fn, x: torch.Tensor, params=()) -> None:
    torch._dynamo.reset()
    want = _step(fn, x, params)
    got = _step(torch.compile(fn, backend='aot_eager', fullgraph=True), x,
                params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('chain, shape', [
    (_cnn_chain, (2, 3, 12, 12)),
    pytest.param(_token_chain, (2, 7, 6), marks=needs_token_kinds)])
def test_lean_modules_trace_without_graph_break(chain, shape):
    modules = chain()
    assert all(is_lean(m) for m in modules if type(m) is not nn.GELU)
    x = torch.randn(shape)
    _check_compiled(modules, x)


def test_lean_resizes_trace_without_graph_break():
    """The resize mode's Function, on a concatenation's channel slice."""
    def fn(x):
        with strided_gradient_resizes():
            up = nn.functional.interpolate(x, size=(11, 13), mode='bilinear')
        return torch.cat([up, up * 2], 1)

    _check_compiled(fn, torch.randn(2, 3, 5, 6))


@pytest.mark.parametrize('dilation', [1, 3])
def test_filtered_conv_traces_on_the_kernels(dilation):
    """``fullgraph=True``; with the CPU kernels built, the compiled step
    runs the fused backward through its operator (one call)."""
    torch.manual_seed(0)
    conv = GFConv2d(4, 5, 3, padding=dilation, dilation=dilation, radius=2)
    x = torch.randn(2, 4, 10, 9)
    calls = conv_cpu.fused_backward_calls() if availability.native_available() else 0
    _check_compiled(conv, x, list(conv.parameters()))
    if availability.native_available() and dilation == 1:
        # eager's C++ node and the compiled graph's operator: one each
        assert conv_cpu.fused_backward_calls() == calls + 2


@KERNELS
def test_native_operators_pass_opcheck():
    x = torch.randn(2, 3, 9, 7)
    rows, cols = [0, 4, 3], [-1, 4, 2]
    for channel_major in (False, True):
        torch.library.opcheck(torch.ops.mmseg_gf.native_patch_sums,
                              (x, rows, cols, channel_major))
    grid = torch.randn(2, 3, 3, 2)
    torch.library.opcheck(torch.ops.mmseg_gf.native_spread,
                          (grid, 9, 7, rows, cols))
    weight = torch.randn(6, 3, 3, 3)
    grad = torch.randn(2, 6, 9, 7)
    pooled = conv_cpu.patch_sums(x, tuple(rows), tuple(cols), True)
    for needs in [(True, True, True), (False, True, False),
                  (True, False, False)]:
        torch.library.opcheck(
            torch.ops.mmseg_gf.native_collapsed_backward,
            (grad, pooled, weight, 1, 1.0, [9, 7], rows, cols, 4, *needs))
    # a channel slice's gradient, with and without the scales
    sliced = torch.randn(2, 6, 11, 13)[:, 1:4]
    for scales in ((None, None), (2.1, 1.9)):
        torch.library.opcheck(torch.ops.mmseg_gf.native_bilinear_backward,
                              (sliced, [2, 3, 5, 6], False, *scales))


def _targets(nodes) -> list:
    return [str(n.target) for n in nodes]


def _recording_compile(fn):
    """``fn`` compiled (``fullgraph=True``, AOTAutograd without code
    generation) and the list its forward and backward graphs' nodes are
    appended to."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(gm.graph.nodes)
        return make_boxed_func(gm.forward)

    return torch.compile(fn, fullgraph=True, backend=aot_autograd(
        fw_compiler=backend, bw_compiler=backend)), seen


def test_pooled_conv_backward_operator():
    """A dilated kernel's pooled-grid backward (the taps reach other
    patches) is an operator under ``torch.compile``, where Inductor would
    otherwise run ``aten.convolution_backward`` channels-last and copy the
    weight's gradient back: opcheck, every combination of gradients."""
    torch.manual_seed(0)
    grad = torch.randn(2, 6, 4, 3)
    padded = torch.randn(2, 4, 8, 7)
    kernel = torch.randn(6, 2, 3, 3)
    for needs in [(True, True), (True, False), (False, True)]:
        torch.library.opcheck(torch.ops.mmseg_gf.pooled_conv_backward,
                              (grad, padded, kernel, [2, 2], 2, *needs))


def test_compiled_dilated_conv_takes_the_pooled_operator():
    """Under ``torch.compile`` a filtered conv whose kernel does not
    collapse calls the pooled-grid operator in its backward, with eager
    mode's gradients."""
    torch.manual_seed(0)
    conv = GFConv2d(4, 5, 3, padding=3, dilation=3, radius=2)
    x = torch.randn(2, 4, 10, 9)
    compiled, seen = _recording_compile(conv)
    got = _step(compiled, x, list(conv.parameters()))
    assert 'mmseg_gf.pooled_conv_backward.default' in _targets(seen)
    want = _step(conv, x, list(conv.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@KERNELS
def test_compiled_collapsed_backward_reads_the_tap_sums():
    """Under ``torch.compile`` the fused collapsed backward's operator is
    given the kernel's tap sums ``W~`` (summed in the graph, at the
    weight's strides there), not the weight: the gradients are eager
    mode's, ``g_W`` in every tap."""
    torch.manual_seed(0)
    conv = GFConv2d(4, 5, 3, padding=1, radius=2)
    x = torch.randn(2, 4, 10, 9)
    compiled, seen = _recording_compile(conv)
    got = _step(compiled, x, list(conv.parameters()))
    op = torch.ops.mmseg_gf.native_collapsed_backward.default
    assert [tuple(n.args[2].meta['val'].shape) for n in seen
            if n.target is op] == [(5, 4, 1, 1)]
    want = _step(conv, x, list(conv.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@KERNELS
def test_compiled_resize_backward_takes_the_kernel():
    """Under ``torch.compile`` a resize's backward is the compiled kernel's
    operator (torch's backward kernel, which the graph called before, took
    7x its time in a PSPNet-R18 step), equal to torch's gradient within
    float32 rounding."""
    def fn(x):
        with strided_gradient_resizes():
            up = nn.functional.interpolate(x, size=(11, 13), mode='bilinear')
        return torch.cat([up, up * 2], 1)

    x = torch.randn(2, 3, 5, 6)
    compiled, seen = _recording_compile(fn)
    got = _step(compiled, x)
    assert 'mmseg_gf.native_bilinear_backward.default' in _targets(seen)
    want = _step(lambda t: torch.cat([
        nn.functional.interpolate(t, size=(11, 13), mode='bilinear')] * 2,
        1) * torch.tensor([1.0] * 3 + [2.0] * 3).view(1, 6, 1, 1), x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not bit_mask.native_available(),
                    reason='compiled bit-mask kernels not built')
def test_bit_mask_operators_pass_opcheck():
    x = torch.randn(3, 5, 7)
    torch.library.opcheck(torch.ops.mmseg_gf.pack_mask,
                          (x, 0.0, 6.0, True))
    bits = bit_mask.pack(x, 0.0)
    torch.library.opcheck(torch.ops.mmseg_gf.apply_mask,
                          (torch.randn(3, 5, 7), bits, 0.1))



@pytest.mark.skipif(not bit_mask.native_available(),
                    reason='compiled bit-mask kernels not built')
def test_bit_mask_operators_take_an_input_stored_otherwise():
    """A traced graph may hand the operators a tensor stored otherwise
    than its trace said (a CPU convolution of one channels-last image
    returns NCHW): they read it in its logical order."""
    x = torch.randn(1, 4, 3, 5).permute(0, 2, 3, 1)  # not contiguous
    bits = torch.ops.mmseg_gf.pack_mask(x, 0.0, 6.0, True)
    assert torch.equal(bits, bit_mask.pack(x.contiguous(), 0.0, 6.0))
    grad = torch.randn(1, 4, 3, 5).permute(0, 2, 3, 1)
    torch.testing.assert_close(
        torch.ops.mmseg_gf.apply_mask(grad, bits, 0.1),
        bit_mask.apply(grad.contiguous(), bits, 0.1), rtol=0, atol=0)

@LOSS_KERNEL
@pytest.mark.parametrize('sigmoid', [False, True])
def test_resized_loss_operator(sigmoid):
    """opcheck (its autograd formula included), and under ``torch.compile``
    the eager kernel's loss and gradient."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, 6, requires_grad=True)
    label = torch.randint(0, 4, (2, 17, 23))
    label[0, :3] = 255
    weight = torch.rand(2, 17, 23)
    op = torch.ops.mmseg_gf.resized_cross_entropy
    torch.library.opcheck(op, (logits, label, weight, 255, False, sigmoid))

    def loss(z):
        total, hits = traced_loss.traced_resized_cross_entropy(
            z, label, weight=weight, sigmoid=sigmoid)
        return total * torch.tensor([1.0, 3.0], dtype=total.dtype), hits

    torch._dynamo.reset()
    got, hits = torch.compile(loss, backend='aot_eager',
                              fullgraph=True)(logits)
    grad, = torch.autograd.grad(got.sum(), logits)
    ref = resized_loss.resized_cross_entropy(logits, label, weight=weight,
                                             sigmoid=sigmoid)
    scale = torch.tensor([1.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(got, ref.loss * scale)
    assert torch.equal(hits, ref.hits)
    # image 1's gradient scaled by 3: the loss is per image
    want = ref.grad * torch.tensor([1.0, 3.0]).view(2, 1, 1, 1)
    torch.testing.assert_close(grad, want)


def test_gf_conv_op_compiles_with_string_padding():
    """The functional entry point (``'same'`` padding) under
    ``fullgraph=True``."""
    torch.manual_seed(0)
    weight = torch.randn(3, 2, 3, 3, requires_grad=True)
    _check_compiled(
        lambda x: gradient_filtered_conv2d(x, weight, None, padding='same',
                                           radius=2), torch.randn(1, 2, 7, 8),
        [weight])


@pytest.mark.parametrize('layout, shape', [('tokens', (2, 1 + 6 * 5, 4)),
                                           ('windows', (3, 3 * 4, 4))])
def test_filtered_linear_traces(layout, shape):
    """The filtered Linear on a token grid under ``fullgraph=True`` (its
    PyTorch path: the token-row kernels are not operators)."""
    torch.manual_seed(0)
    grid = TokenGrid(6, 5, extra_tokens=1) if layout == 'tokens' else \
        TokenGrid(3, 4, layout='windows')
    weight = torch.randn(3, 4, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    _check_compiled(
        lambda x: gradient_filtered_linear(x, weight, bias, grid, radius=2),
        torch.randn(shape), [weight, bias])


@needs_token_kinds
def test_lean_attention_traces():
    """A frozen ``nn.MultiheadAttention`` through SDPA (its lean kind)."""
    torch.manual_seed(0)
    attention = _frozen(nn.MultiheadAttention(8, 2, batch_first=True))
    make_lean(attention)
    assert is_lean(attention)
    key = torch.randn(2, 5, 8)
    _check_compiled(lambda q: attention(q, key, key, need_weights=False)[0],
                    torch.randn(2, 7, 8))
