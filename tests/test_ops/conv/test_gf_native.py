"""The compiled CPU kernels against the pure-PyTorch path.

Both paths must give the same numbers for every geometry (padding before
the map, patches running past it, strides, partial patches); the reference
tests in test_gf_op.py run with whichever path is active.
"""
import itertools
import os

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

from mmseg_gf.ops import gradient_filtered_conv2d
from mmseg_gf.ops.backend import availability, cpu_settings, output_pool
from mmseg_gf.ops.conv import cpu as conv_cpu
from mmseg_gf.ops.conv.function import (AxisGeometry,
                                        GradientFilterConv2dFunction,
                                        filter_output_grad, pool_input_patches,
                                        spread_to_input)

pytestmark = pytest.mark.skipif(
    not availability.native_available(),
    reason='compiled kernels not built (pip install --no-build-isolation -e .)')


def _out_sizes(size, k, s, p, d):
    return [(v + 2 * p - d * (k - 1) - 1) // s + 1 for v in size]


# stride, kernel, padding, dilation, radius, input size (non-empty outputs);
# rows of 47 float64 values are 'long' for the pooling kernel (added one
# row at a time), the others short (2 or 4 rows added in one pass).
CASES = [
    case for case in itertools.product((1, 2), (1, 3, 5), (0, 1, 3), (1, 2, 5),
                                       (2, 3, 4),
                                       ((7, 9), (13, 11), (2, 1), (6, 47)))
    if min(_out_sizes(case[5], *case[1:2], case[0], *case[2:4])) >= 1
]


@pytest.mark.parametrize('s,k,p,d,r,size', CASES)
def test_pooling_and_spread_match_pure_torch(switch_override, s, k, p, d, r,
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
    switch_override(MMSEG_GF_NATIVE=False)
    slow = (pool_input_patches(x, geo_h, geo_w),
            filter_output_grad(g, geo_h, geo_w, torch.float64),
            spread_to_input(grid, geo_h, geo_w))
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast[1], slow[1], rtol=1e-12, atol=1e-12)
    assert torch.equal(fast[2], slow[2])
    assert fast[2].shape == x.shape


def test_whole_operator_float32_matches_pure_torch(switch_override):
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
    switch_override(MMSEG_GF_NATIVE=False)
    slow = grads()
    for a, b_ in zip(fast, slow):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_unsupported_inputs_use_the_pure_path():
    """bf16, channels_last and non-CPU tensors are not for the kernels."""
    t = torch.randn(1, 2, 4, 4)
    assert conv_cpu.usable(t)
    assert not conv_cpu.usable(t.bfloat16())
    assert not conv_cpu.usable(t.contiguous(memory_format=torch.channels_last))
    assert not conv_cpu.usable(t.transpose(2, 3))


def _gradients(x, w, b, g, conv_args, needs):
    """``(g_x, g_W, g_b)`` of the operator, ``None`` where not required."""
    leaves = [None if t is None else t.clone().requires_grad_(need)
              for t, need in zip((x, w, b), needs)]
    out = gradient_filtered_conv2d(*leaves, *conv_args)
    asked = [t is not None and t.requires_grad for t in leaves]
    grads = iter(torch.autograd.grad(
        out, [t for t, a in zip(leaves, asked) if a], g))
    return [next(grads) if a else None for a in asked]


class _CallsSince:
    """The fused compiled backward's calls since the fixture started (from
    the C++ autograd node or the Python Function): ``len`` counts them."""

    def __init__(self):
        self.start = conv_cpu.fused_backward_calls()

    def __len__(self):
        return conv_cpu.fused_backward_calls() - self.start


@pytest.fixture
def fused_calls():
    return _CallsSince()


# stride, kernel, padding, groups (of 4 channels), radius, input size
FUSED_CASES = [
    (1, 3, 1, 1, 4, (14, 14)),  # partial last patch (14 = 3 * 4 + 2)
    (1, 3, 1, 1, 2, (8, 6)),
    (2, 3, 1, 1, 2, (13, 11)),  # strided: input patches of r*s pixels
    (1, 1, 0, 1, 3, (7, 9)),
    (1, 3, 0, 2, 2, (9, 10)),  # grouped, no padding (patches start inside)
    (2, 5, 2, 4, 4, (17, 15)),  # depthwise
    (1, 3, 3, 1, 2, (5, 5)),  # wide padding: patches start outside the map
]


@pytest.mark.parametrize('needs', [(True, True, True), (False, True, False),
                                   (True, False, True), (True, True, False)])
@pytest.mark.parametrize('s,k,p,groups,r,size', FUSED_CASES)
def test_fused_backward_matches_stepwise_path(switch_override, fused_calls,
                                              s, k, p, groups, r, size,
                                              needs):
    gen = torch.Generator().manual_seed(s * 100 + k * 10 + r)
    x = torch.randn(3, 4, *size, generator=gen, dtype=torch.float64)
    out_channels = 4 if groups == 4 else 6
    w = torch.randn(out_channels, 4 // groups, k, k, generator=gen,
                    dtype=torch.float64)
    b = torch.randn(w.shape[0], generator=gen, dtype=torch.float64)
    out_size = _out_sizes(size, k, s, p, 1)
    g = torch.randn(3, w.shape[0], *out_size, generator=gen,
                    dtype=torch.float64)
    conv_args = (s, p, 1, groups, r)
    fused = _gradients(x, w, b, g, conv_args, needs)
    assert len(fused_calls) == 1
    switch_override(MMSEG_GF_NATIVE=False)
    stepwise = _gradients(x, w, b, g, conv_args, needs)
    assert len(fused_calls) == 1
    for a, ref in zip(fused, stepwise):
        if ref is None:
            assert a is None
        else:
            torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12)


def _node_kind(out):
    name = out.grad_fn.name()
    if 'GradientFilteredConv2d' in name:
        return 'C++'
    assert name == 'GradientFilterConv2dFunctionBackward', name
    return 'Python'


def test_usual_case_takes_the_cpp_node_others_the_python_function():
    x = torch.randn(2, 4, 9, 9)
    w = torch.randn(4, 4, 3, 3, requires_grad=True)

    def kind(x=x, w=w, dilation=1, radius=2):
        return _node_kind(
            gradient_filtered_conv2d(x, w, None, 1, dilation, dilation, 1,
                                     radius))

    assert kind() == 'C++'
    assert kind(dilation=2, radius=4) == 'C++'  # taps within one patch
    assert kind(dilation=4, radius=2) == 'Python'  # taps reach other patches
    assert kind(x=x.contiguous(memory_format=torch.channels_last)) == 'Python'
    assert kind(x=x.double(), w=w.detach().double().requires_grad_()) == 'C++'
    assert kind(x=x.bfloat16(),
                w=w.detach().bfloat16().requires_grad_()) == 'Python'
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert kind() == 'Python'
    with torch.no_grad():  # nothing to differentiate: the plain conv
        out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2)
    assert out.grad_fn is None
    assert torch.equal(out, torch.nn.functional.conv2d(x, w, None, 1, 1))


@pytest.mark.parametrize('needs', [(True, True, True), (False, True, False),
                                   (True, False, True), (False, False, True)])
@pytest.mark.parametrize('s,k,p,groups,r,size', FUSED_CASES)
def test_cpp_node_equals_python_function(fused_calls, s, k, p, groups, r,
                                         size, needs):
    """Both nodes run the same compiled backward: identical numbers, and
    the C++ node's forward saves exactly the Function's tensors."""
    gen = torch.Generator().manual_seed(s * 100 + k * 10 + r)
    x = torch.randn(2, 4, *size, generator=gen)
    w = torch.randn(4 if groups == 4 else 6, 4 // groups, k, k, generator=gen)
    b = torch.randn(w.shape[0], generator=gen)
    g = torch.randn(2, w.shape[0], *_out_sizes(size, k, s, p, 1),
                    generator=gen)
    results = {}
    for node in ('C++', 'Python'):
        leaves = [t.clone().requires_grad_(need)
                  for t, need in zip((x, w, b), needs)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t):
            if node == 'C++':
                out = gradient_filtered_conv2d(*leaves, s, p, 1, groups, r)
            else:
                out = GradientFilterConv2dFunction.apply(
                    *leaves, (s, s), (p, p), (1, 1), groups, r)
        assert _node_kind(out) == node
        asked = [t for t in leaves if t.requires_grad]
        results[node] = (out, saved, torch.autograd.grad(out, asked, g))
    (out, saved, grads), (ref_out, ref_saved, ref_grads) = (results['C++'],
                                                           results['Python'])
    assert len(fused_calls) == 2
    assert torch.equal(out, ref_out)
    assert [t.shape for t in saved] == [t.shape for t in ref_saved]
    for a, ref in zip(saved + list(grads), ref_saved + list(ref_grads)):
        assert a.dtype == ref.dtype and torch.equal(a, ref)


def test_cpp_node_non_contiguous_grad_and_double_backward():
    """A channels-last g_y is read correctly; create_graph gives the first
    derivatives, and differentiating them again raises (as the Python
    Function's @once_differentiable does) instead of giving wrong ones."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 8, 8, generator=gen, requires_grad=True)
    w = torch.randn(5, 3, 3, 3, generator=gen, requires_grad=True)
    out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2)
    assert _node_kind(out) == 'C++'
    g = torch.randn(2, 5, 8, 8, generator=gen)
    ref = torch.autograd.grad(out, (x, w), g, retain_graph=True)
    got = torch.autograd.grad(
        out, (x, w), g.contiguous(memory_format=torch.channels_last),
        retain_graph=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    gx, gw = torch.autograd.grad(out, (x, w), g, create_graph=True)
    assert torch.equal(gx, ref[0]) and torch.equal(gw, ref[1])
    with pytest.raises(RuntimeError, match='not differentiable'):
        gw.sum().backward()


@pytest.mark.parametrize('node', ['C++', 'Python'])
def test_forward_mode_and_func_transforms_raise(switch_override, node):
    """Neither node defines forward-mode AD or functorch rules: both raise
    (docs/reliability.md) rather than give a wrong derivative."""
    if node == 'Python':
        switch_override(MMSEG_GF_NATIVE=False)
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    assert _node_kind(gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1,
                                               2)) == node

    def filtered(x, w):
        return gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2)

    with pytest.raises(RuntimeError, match='jvp'):
        with forward_ad.dual_level():
            filtered(forward_ad.make_dual(x, torch.randn_like(x)), w)
    with pytest.raises(RuntimeError):
        torch.func.grad(lambda w: filtered(x, w).sum())(w.detach())
    with pytest.raises(RuntimeError):
        torch.func.vmap(lambda xi: filtered(xi, w))(x[:, None])


def test_fused_backward_float32_large_map(fused_calls, switch_override):
    """Large enough (8 MiB g_x) for the huge-page-advised outputs."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 384, 384, generator=gen)
    w = torch.randn(8, 8, 3, 3, generator=gen)
    b = torch.randn(8, generator=gen)
    g = torch.randn(2, 8, 384, 384, generator=gen)
    fused = _gradients(x, w, b, g, (1, 1, 1, 1, 4), (True, True, True))
    assert len(fused_calls) == 1
    switch_override(MMSEG_GF_NATIVE=False)
    stepwise = _gradients(x, w, b, g, (1, 1, 1, 1, 4), (True, True, True))
    for a, ref in zip(fused, stepwise):
        torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-4)


def _backward_ops(out, inputs, g):
    """Gradients of ``out`` w.r.t. ``inputs``, and the aten ops they ran."""
    with torch.profiler.profile() as prof:
        grads = torch.autograd.grad(out, inputs, g, retain_graph=True)
    return grads, {event.name for event in prof.events()}


@pytest.fixture
def onednn_products():
    """Sets whether large products may run on oneDNN for one test; returns
    the setting it replaced, and restores the first one afterwards."""
    previous = []

    def set_products(enabled):
        previous.append(cpu_settings.set_onednn_products(enabled))
        return previous[-1]

    yield set_products
    if previous:
        cpu_settings.set_onednn_products(previous[0])


@pytest.mark.parametrize('allowed,channels,batch,size,convs,gemms', [
    (True, 512, 2, 32, True, False),  # both products 512 x 512 x 512
    (True, 64, 2, 32, False, True),  # 64 x 64 x 512
    (True, 512, 5, 64, True, True),  # 512 x 512 x 5120: x~^T (10 MB) not copied
    (False, 512, 2, 32, False, True),  # MKL only
])
def test_fused_gemms_on_onednn_only_when_large(switch_override, fused_calls,
                                               onednn_products, allowed,
                                               channels, batch, size, convs,
                                               gemms):
    """Where allowed, the fused backward's two products run as oneDNN 1x1
    convolutions when they are large in every dimension and need at most
    8 MiB copied first (see grouped_matmul), as batched GEMMs otherwise;
    either way the gradients are the stepwise path's, and stay float32 if
    autocast is left on around the backward."""
    onednn_products(allowed)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, channels, size, size, generator=gen,
                    requires_grad=True)
    w = (torch.randn(channels, channels, 3, 3, generator=gen) /
         (9 * channels)**0.5).requires_grad_()
    g = torch.randn(batch, channels, size, size, generator=gen)
    out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2)
    fused, ops = _backward_ops(out, (x, w), g)
    assert len(fused_calls) == 1
    assert ('aten::conv2d' in ops) == convs
    assert ('aten::bmm' in ops) == gemms
    with torch.autocast('cpu', dtype=torch.bfloat16):
        under_autocast = torch.autograd.grad(out, (x, w), g,
                                             retain_graph=True)
    switch_override(MMSEG_GF_NATIVE=False)
    stepwise = torch.autograd.grad(
        gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2), (x, w), g)
    for a, auto, ref in zip(fused, under_autocast, stepwise):
        assert a.dtype == auto.dtype == torch.float32
        # float32 sums of 512-5120 products, in another order
        scale = ref.abs().max().item()
        torch.testing.assert_close(a, ref, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(auto, a, rtol=0, atol=0)


@pytest.mark.skipif(not os.path.exists('/proc/cpuinfo'), reason='Linux only')
def test_onednn_products_default_to_what_the_cpu_prefers(onednn_products):
    """Allowed by default only on AMD CPUs with full-width AVX-512 (Zen 5,
    CPU family 1Ah, and later)."""
    with open('/proc/cpuinfo') as cpuinfo:
        info = cpuinfo.read()
    amd = 'AuthenticAMD' in info  # (an aarch64 cpuinfo has no cpu family)
    family = int(info.split('cpu family')[1].split(':')[1].split()[0]) \
        if amd else 0
    expected = amd and ' avx512f' in info and family >= 0x1a
    assert cpu_settings.onednn_products_preferred() == expected
    assert onednn_products(not expected) == expected  # the default
    assert onednn_products(expected) == (not expected)


def test_fused_backward_only_where_it_applies(fused_calls):
    """Dilated taps reaching other patches, and autocast's mixed dtypes,
    take the step-by-step path."""
    x = torch.randn(1, 2, 12, 12)
    w = torch.randn(2, 2, 3, 3)
    g = torch.randn(1, 2, 12, 12)
    _gradients(x, w, None, g, (1, 4, 4, 1, 2), (True, True, False))
    assert not fused_calls  # dilation 4 >= r * s: kernel keeps its taps
    with torch.autocast('cpu', dtype=torch.bfloat16):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = gradient_filtered_conv2d(xs, ws, None, 1, 1, 1, 1, 2)
    out.float().sum().backward()
    assert not fused_calls
    _gradients(x, w, None, g, (1, 2, 2, 1, 4), (True, True, False))
    assert len(fused_calls) == 1  # dilation 2 < r * s: collapsed


def test_forward_saves_patch_sums_channel_major():
    """The saved patch sums are laid out as the fused weight GEMM reads
    them (C x N x cells in memory), so the backward copies nothing."""
    saved = []
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2)
    pooled = [t for t in saved if t.shape == (2, 3, 4, 4)]
    assert len(pooled) == 1
    assert pooled[0].permute(1, 0, 2, 3).is_contiguous()


def _spread_by_4(grid):
    """``grid`` spread over 4 x 4 patches: an output 16x its size."""
    h, w = grid.shape[2:]
    return conv_cpu.spread(grid, 4 * h, 4 * w, (0, 4, h), (0, 4, w))


@pytest.fixture
def recycler():
    """A recycling pool of 64 MiB for the test, empty before and after."""
    output_pool.release_recycled()
    previous = output_pool.recycle_limit(64 << 20)
    yield
    output_pool.recycle_limit(previous)
    output_pool.release_recycled()


def test_large_outputs_reuse_freed_memory(recycler):
    """A freed 9 MiB spread goes back to the pool and the next output of
    the same size is written into the same memory, with correct values."""
    grid = torch.randn(2, 8, 96, 96)
    first = _spread_by_4(grid)
    address, nbytes = first.data_ptr(), first.nbytes
    assert nbytes >= 8 << 20 and output_pool.recycled_bytes() == 0
    del first
    assert output_pool.recycled_bytes() == nbytes
    grid2 = torch.randn(2, 8, 96, 96)
    second = _spread_by_4(grid2)
    assert second.data_ptr() == address and output_pool.recycled_bytes() == 0
    expected = grid2.repeat_interleave(4, 2).repeat_interleave(4, 3)
    assert torch.equal(second, expected)
    # A different size cannot take the kept block: fresh memory.
    del second
    other = _spread_by_4(torch.randn(2, 8, 100, 100))
    assert other.data_ptr() != address
    assert output_pool.recycled_bytes() == nbytes


def test_lean_backward_outputs_reuse_freed_memory(recycler):
    """The lean region's full-size backward outputs (an activation's
    masked gradient, a frozen norm's scaled one) take the pool's blocks:
    the second backward writes into the first one's freed memory, and the
    gradients stay autograd's."""
    from mmseg_gf.ops.bit_mask import masks as bit_mask
    from mmseg_gf.ops.lean.functions import FrozenAffineNormFunction
    x = torch.randn(2, 16, 64, 64)
    grad = torch.randn_like(x)
    scale = torch.rand(16)
    bits = bit_mask.pack(x)
    masked = bit_mask.apply(grad, bits)
    address = masked.data_ptr()
    assert torch.equal(masked, grad * (x > 0))
    del masked
    assert output_pool.recycled_bytes() == grad.nbytes
    leaf = x.clone().requires_grad_(True)
    out = FrozenAffineNormFunction.apply(leaf, scale, lambda t: t * 1.0)
    out.backward(grad)
    assert leaf.grad.data_ptr() == address
    torch.testing.assert_close(leaf.grad, grad * scale.view(1, -1, 1, 1),
                               rtol=0, atol=0)


def test_recycling_pool_respects_its_limit(recycler):
    """Least recently returned blocks are freed beyond the limit; a limit
    of 0 keeps nothing; outputs below 128 KiB never enter the pool."""
    grids = [torch.randn(2, 8, 96, 96 + i) for i in range(3)]
    outs = [_spread_by_4(g) for g in grids]
    sizes = [o.nbytes for o in outs]
    output_pool.recycle_limit(sizes[1] + sizes[2])
    for i in range(3):  # returned in order 0, 1, 2: block 0 is dropped
        outs[i] = None
    assert output_pool.recycled_bytes() == sizes[1] + sizes[2]
    output_pool.recycle_limit(0)
    assert output_pool.recycled_bytes() == 0
    output_pool.recycle_limit(64 << 20)
    # 256 KiB is recycled; 64 KiB (malloc's heap reuses it) is not.
    medium = _spread_by_4(torch.randn(1, 1, 64, 64))
    address = medium.data_ptr()
    del medium
    assert output_pool.recycled_bytes() == 256 << 10
    medium = _spread_by_4(torch.randn(1, 1, 64, 64))
    assert medium.data_ptr() == address
    small = _spread_by_4(torch.randn(1, 1, 32, 32))
    del small
    assert output_pool.recycled_bytes() == 0


def test_fused_backward_gradients_survive_recycling(recycler, switch_override):
    """Two backward calls in a row: the second reuses the first's freed
    g_x memory and both match the step-by-step path."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 384, 384, generator=gen)
    w = torch.randn(8, 8, 3, 3, generator=gen)
    g = torch.randn(2, 8, 384, 384, generator=gen)
    needs = (True, True, False)
    grad_x, grad_w, _ = _gradients(x, w, None, g, (1, 1, 1, 1, 4), needs)
    address, reference = grad_x.data_ptr(), (grad_x.clone(), grad_w.clone())
    del grad_x
    assert output_pool.recycled_bytes() >= 8 << 20
    grad_x, grad_w, _ = _gradients(x, w, None, g, (1, 1, 1, 1, 4), needs)
    assert grad_x.data_ptr() == address
    assert torch.equal(grad_x, reference[0])
    assert torch.equal(grad_w, reference[1])
    switch_override(MMSEG_GF_NATIVE=False)
    stepwise = _gradients(x, w, None, g, (1, 1, 1, 1, 4), needs)
    torch.testing.assert_close(grad_x, stepwise[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_w, stepwise[1], rtol=1e-4, atol=1e-4)


def test_profiled_peak_counts_recycled_outputs(recycler):
    """The profiler-based peak of a step does not lose the g_x written into
    memory recycled from the step before (recycling is off while it runs)."""
    from mmseg_gf.accounting.measured import profiled_peak_bytes
    x = torch.randn(2, 8, 384, 384, requires_grad=True)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    g = torch.randn(2, 8, 384, 384)

    def step():
        out = gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 4)
        torch.autograd.grad(out, (x, w), g)  # g_x dies here: pooled

    step()
    assert output_pool.recycled_bytes() >= x.nbytes
    peaks = [profiled_peak_bytes(step) for _ in range(2)]
    assert peaks[0] == peaks[1]
    assert peaks[0] >= 2 * x.nbytes  # the forward output and g_x
    assert output_pool.recycle_limit(64 << 20) == 64 << 20  # restored afterwards
