"""Cases of the Triton path; run by ``tests/test_ops/conv/test_gf_triton.py`` in a subprocess.

Not collected on its own (the name does not start with ``test_``): triton
decides at import whether its kernels run compiled or interpreted, from
``TRITON_INTERPRET``, and that setting must not leak into the rest of the
suite (every CPU conv would then take the interpreter). Run directly::

    TRITON_INTERPRET=1 python -m pytest -q tests/helpers/triton_cases.py
    python -m pytest -q tests/helpers/triton_cases.py  # CUDA

Under the interpreter the tensors are CPU tensors and the shapes tiny (it
runs every program in Python); on a GPU the same cases run compiled.
"""
import itertools

import pytest
import torch
import triton

from mmseg_gf.accounting.launches import LaunchCounter, counting
from mmseg_gf.ops import gradient_filtered_conv2d
from mmseg_gf.ops.conv import gpu as conv_gpu
from tests.helpers.triton_runs import case_device, pytorch_path
from tests.helpers.gf_reference import reference_gradients

DEVICE = case_device()

# (name, groups, in channels, out channels)
CHANNELS = {'dense': (1, 2, 3), 'grouped': (2, 4, 2), 'depthwise': (2, 2, 2)}


def _geometry(stride, kernel, kind, radius):
    """Padding and input size of a case: an output of ``2r+1 x 3r+1``
    pixels, so the last patch row is partial, plus ``s-1`` input pixels
    beyond the last patch (they get no gradient). Padding: 0 or 1, so
    that both 1x1 and 3x3 kernels are seen with and without it."""
    padding = {'dense': kernel // 2, 'grouped': 1, 'depthwise': 0}[kind]
    out = (2 * radius + 1, 3 * radius + 1)
    size = tuple((o - 1) * stride + kernel - 2 * padding + stride - 1
                 for o in out)
    return padding, size


def _tensors(stride, kernel, kind, radius, dtype, batch=2):
    groups, ci, co = CHANNELS[kind]
    padding, size = _geometry(stride, kernel, kind, radius)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, ci, *size, generator=gen, dtype=dtype)
    w = torch.randn(co, ci // groups, kernel, kernel, generator=gen,
                    dtype=dtype)
    b = torch.randn(co, generator=gen, dtype=dtype)
    return x, w, b, padding, groups


def _filtered(x, w, b, stride, padding, groups, radius, grad_fn,
              need=(True, True, True)):
    """Forward on DEVICE, backward with ``grad_fn(out)``; returns the
    output and the gradients (``None`` where not asked for) on the CPU."""
    leaves = [t.to(DEVICE).requires_grad_(flag) if t is not None else None
              for t, flag in zip((x, w, b), need)]
    out = gradient_filtered_conv2d(leaves[0], leaves[1], leaves[2], stride,
                                   padding, 1, groups, radius)
    grad_out = grad_fn(out)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad_out))
    return out, grad_out, [
        next(grads).cpu() if t is not None and t.requires_grad else None
        for t in leaves
    ]


def _randn_like(seed):
    def make(out):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(out.shape, generator=gen,
                           dtype=out.dtype).to(out.device)
    return make


# Every stride x kernel x group kind at r = 2; r = 1 and 4 on a covering
# subset (each kind, stride and kernel once or more; the interpreter's time
# is what bounds the count). The 3x3 stride-1 case at r = 1 is the control
# whose taps reach other patches. Stride 3 scales by 1/9, which float32
# does not hold exactly.
GRID = (list(itertools.product((1, 2), (1, 3), sorted(CHANNELS), (2, ))) +
        [(1, 3, 'dense', 4), (2, 3, 'grouped', 4), (2, 1, 'depthwise', 4),
         (1, 1, 'grouped', 4), (2, 3, 'dense', 1), (1, 1, 'depthwise', 1),
         (2, 1, 'grouped', 1), (1, 3, 'dense', 1), (3, 1, 'dense', 2)])


@pytest.mark.parametrize('stride,kernel,kind,radius', GRID)
def test_float64_matches_independent_reference(stride, kernel, kind, radius):
    """Every stride / kernel / group kind / radius, partial border patches,
    padding and uncovered pixels: the Triton path gives the gradients of
    docs/gradient_filter.md (#backward, #partial-patches)
    to float64 rounding (``tests/helpers/gf_reference.py``, explicit loops). A
    3x3 kernel at ``r * s = 1`` has taps in other patches: it stays on the
    step-by-step route. (One image: the interpreter's time grows with the
    number of programs; the other tests cover batches.)"""
    x, w, b, padding, groups = _tensors(stride, kernel, kind, radius,
                                        torch.float64, batch=1)
    calls = conv_gpu.backward_calls()
    _, grad_out, (gx, gw, gb) = _filtered(x, w, b, stride, padding, groups,
                                          radius, _randn_like(1))
    collapsed = kernel == 1 or radius * stride > 1
    assert conv_gpu.backward_calls() == calls + collapsed
    rx, rw, rb = reference_gradients(x, w, grad_out.cpu(), (stride, stride),
                                     (padding, padding), (1, 1), groups,
                                     radius)
    for got, want in ((gx, rx), (gw, rw), (gb, rb)):
        assert got.dtype == torch.float64 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _pure_torch(x, w, b, stride, padding, groups, radius, grad_fn, need):
    """The same conv on the CPU's pure-PyTorch Function."""
    global DEVICE
    device, DEVICE = DEVICE, 'cpu'
    try:
        with pytorch_path():
            return _filtered(x, w, b, stride, padding, groups, radius,
                             grad_fn, need)
    finally:
        DEVICE = device


# All but (False, False, False): with nothing to differentiate autograd
# records no node.
@pytest.mark.parametrize(
    'need', list(itertools.product((True, False), repeat=3))[:-1])
def test_float32_every_combination_of_needed_gradients(need):
    """Input, weight, bias each needed or not (no bias at all when it is
    not): the gradients asked for match the pure-PyTorch path, the others
    are None, and x's patch sums are saved only for the weight gradient."""
    need_x, need_w, need_b = need
    x, w, b, padding, groups = _tensors(2, 3, 'grouped', 2, torch.float32)
    if not need_b:
        b = None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        _, _, got = _filtered(x, w, b, 2, padding, groups, 2,
                              _randn_like(2), need)
    _, _, want = _pure_torch(x, w, b, 2, padding, groups, 2, _randn_like(2),
                             need)
    # Ci x N x ph x pw: the 5 x 7 output in 2 x 2 patches
    pooled_shape = (x.shape[1], x.shape[0], 3, 4)
    assert (pooled_shape in saved) == need_w
    for flag, g, r in zip(need, got, want):
        if not flag:
            assert g is None
            continue
        torch.testing.assert_close(g, r, rtol=1e-5,
                                   atol=1e-6 * float(r.abs().max()))


def test_non_contiguous_output_gradients():
    """``g_y`` of any strides is read in place: an expanded constant (the
    gradient of ``out.sum()``) and a transposed copy."""
    x, w, b, padding, groups = _tensors(1, 3, 'dense', 2, torch.float32)
    for grad_fn in (lambda out: torch.ones((), dtype=out.dtype,
                                           device=out.device).expand_as(out),
                    lambda out: _randn_like(3)(out).transpose(2, 3)
                    .contiguous().transpose(2, 3)):
        _, grad_out, got = _filtered(x, w, b, 1, padding, groups, 2, grad_fn)
        assert not grad_out.is_contiguous()
        _, _, want = _pure_torch(x, w, b, 1, padding, groups, 2, grad_fn,
                                 (True, True, True))
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-5,
                                       atol=1e-6 * float(r.abs().max()))


def test_autocast_reduced_precision_accumulates_in_float32():
    """Under autocast ``g_y`` is bfloat16 (float16 too on CUDA); its patch
    means, the products and the bias sum run in float32 and ``g_x`` comes
    back in x's dtype. So the gradients are the float32 ones of the rounded
    ``g_y``, to float32 rounding. (The pure-PyTorch path rounds ``g_y``'s
    patch sums to its dtype first: up to 2^-8 relative for bfloat16.)"""
    x, w, b, padding, groups = _tensors(2, 3, 'dense', 4, torch.float32)
    dtypes = [torch.bfloat16] + ([torch.float16] if DEVICE == 'cuda' else [])
    for dtype in dtypes:
        with torch.autocast(DEVICE, dtype=dtype):
            out, grad_out, got = _filtered(x, w, b, 2, padding, groups, 4,
                                           _randn_like(4))
        assert out.dtype == grad_out.dtype == dtype
        rounded = grad_out.float().cpu()
        _, _, want = _pure_torch(x, w, b, 2, padding, groups, 4,
                                 lambda out: rounded, (True, True, True))
        for g, r in zip(got, want):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, r, rtol=1e-5,
                                       atol=1e-6 * float(r.abs().max()))


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations and dispatch of both ops, as
    ``torch.compile`` and CUDA graphs rely on them."""
    x, w, _, _, _ = _tensors(2, 3, 'grouped', 2, torch.float32, batch=1)
    x, w = x.to(DEVICE), w.to(DEVICE)
    rows, cols = (0, 4, 3), (-1, 4, 2)
    torch.library.opcheck(torch.ops.mmseg_gf.triton_patch_sums,
                          (x, *rows, *cols))
    pooled = torch.ops.mmseg_gf.triton_patch_sums(x, *rows, *cols)
    grad_out = torch.randn(1, 2, 5, 3, device=DEVICE)
    torch.library.opcheck(
        torch.ops.mmseg_gf.triton_collapsed_backward,
        (grad_out, pooled, w, 2, 0.25, x.shape[2], x.shape[3], list(rows),
         list(cols), 2, x.dtype, True, True, True))


def test_torch_compile_traces_the_custom_ops():
    """``torch.compile(fullgraph=True)`` traces the Function and both ops
    (no graph break) and gives the eager gradients. (``aot_eager``: the
    interpreter cannot run inductor's generated kernels; on CUDA the
    inductor + CUDA-graph case is ``test_gf_triton``'s.)"""
    x, w, b, padding, groups = _tensors(1, 3, 'dense', 2, torch.float32)
    x, w, b = (t.to(DEVICE) for t in (x, w, b))

    def loss(x, w, b):
        out = gradient_filtered_conv2d(x, w, b, 1, padding, 1, groups, 2)
        return (out * out).sum()

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    eager = grads(loss)
    calls = conv_gpu.backward_calls()
    got = grads(torch.compile(loss, backend='aot_eager', fullgraph=True))
    assert conv_gpu.backward_calls() == calls + 1
    for g, r in zip(got, eager):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_double_backward_raises():
    x, w, b, padding, groups = _tensors(1, 1, 'dense', 2, torch.float32)
    x = x.to(DEVICE).requires_grad_()
    w = w.to(DEVICE).requires_grad_()
    out = gradient_filtered_conv2d(x, w, None, 1, padding, 1, groups, 2)
    # g_y = 2 * out depends on x: a second backward would need ours.
    (gx, ) = torch.autograd.grad((out * out).sum(), (x, ), create_graph=True)
    with pytest.raises(RuntimeError, match='differentiate twice'):
        gx.sum().backward()


# ----------------------------------------------------------------------------
# Kernel launches of one filtered backward, and channels-last inputs


def _count_backward(x, w, b, stride, padding, groups, radius, need):
    """Launches of one backward (``torch.autograd.grad``) of the Triton
    path's conv; the forward runs outside the count."""
    leaves = [t.to(DEVICE).requires_grad_(flag) if t is not None else None
              for t, flag in zip((x, w, b), need)]
    out = gradient_filtered_conv2d(leaves[0], leaves[1], leaves[2], stride,
                                   padding, 1, groups, radius)
    grad_out = _randn_like(7)(out)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    counter = LaunchCounter()
    counter.phase('backward')
    calls = conv_gpu.backward_calls()
    with counting(counter):
        torch.autograd.grad(out, wanted, grad_out)
    assert conv_gpu.backward_calls() == calls + 1
    return counter.result


# (kind, kernel, bias, need x / w / b) -> (Triton launches, torch kernels).
# The fewest the design allows, dense, grouped and depthwise alike: one
# pass over g_y (patch means, the bias's partial sums and, when g_x needs
# a k x k kernel's W~, its tap sums in further programs), one launch for
# both products (g_W in every tap and g_b; g_x written from the registers;
# ops/conv/products_kernels.py).
LAUNCHES = {
    ('dense', 1, False, (True, True, False)): (2, 0),
    ('dense', 1, True, (True, True, True)): (2, 0),
    ('dense', 3, True, (True, True, True)): (2, 0),
    ('dense', 3, False, (False, True, False)): (2, 0),
    ('dense', 3, False, (True, False, False)): (2, 0),
    ('grouped', 3, True, (True, True, True)): (2, 0),
    # padding 0: Q(0) starts at pixel 1, g_x is zeroed before the spread
    ('depthwise', 3, True, (True, True, True)): (2, 1),
    ('depthwise', 1, False, (True, True, False)): (2, 0),
}


@pytest.mark.parametrize('case', sorted(LAUNCHES), ids=str)
def test_backward_launch_count(case):
    """One filtered conv's backward launches exactly :data:`LAUNCHES`'
    kernels, and no cast, copy or contiguous of a full-size tensor."""
    kind, kernel, bias, need = case
    x, w, b, padding, groups = _tensors(2, kernel, kind, 2, torch.float32)
    counted = _count_backward(x, w, b if bias else None, 2, padding, groups,
                              2, need)
    triton = counted.triton()
    assert (triton, counted.count() - triton) == LAUNCHES[case], \
        counted.by_op()


@pytest.mark.parametrize('kind', ['dense', 'depthwise'])
def test_channels_last_weight_gives_the_same_gradients(kind):
    """A model moved to channels-last stores its 4-d weights so (taps not
    adjacent): the fused kernels' tap sums and ``g_W`` are those of the
    contiguous weight."""
    x, w, b, padding, groups = _tensors(1, 3, kind, 2, torch.float64)
    _, grad_out, want = _filtered(x, w, b, 1, padding, groups, 2,
                                  _randn_like(6))
    w_last = w.contiguous(memory_format=torch.channels_last)
    assert not w_last.is_contiguous() or w.shape[1] == 1
    _, _, got = _filtered(x, w_last, b, 1, padding, groups, 2,
                          lambda out: grad_out)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('kind', sorted(CHANNELS))
def test_channels_last_input_takes_the_triton_path(kind):
    """A channels-last input and ``g_y`` take the Triton path (read in
    place, programs ordered channel first), give the pure-PyTorch path's
    gradients and return ``g_x`` channels-last."""
    x, w, b, padding, groups = _tensors(2, 3, kind, 2, torch.float32)
    last = torch.channels_last
    x = x.contiguous(memory_format=last)

    def grad_fn(out):
        return _randn_like(5)(out).contiguous(memory_format=last)

    calls = conv_gpu.backward_calls()
    _, grad_out, got = _filtered(x, w, b, 2, padding, groups, 2, grad_fn)
    assert conv_gpu.backward_calls() == calls + 1
    assert grad_out.is_contiguous(memory_format=last)
    assert got[0].is_contiguous(memory_format=last)
    _, _, want = _pure_torch(x.contiguous(), w, b, 2, padding, groups, 2,
                             lambda out: grad_out.cpu().contiguous(),
                             (True, True, True))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5,
                                   atol=1e-6 * float(r.abs().max()))


@pytest.mark.parametrize('kernel,stride,padding,groups,ci,co', [
    (3, 1, 0, 1, 70, 72), (1, 2, 0, 1, 70, 72), (3, 2, 0, 70, 70, 70),
    (3, 2, 1, 2, 70, 72), (3, 2, 1, 12, 12, 72)])
def test_fused_products_and_the_gemm_route_agree(kernel, stride, padding,
                                                 groups, ci, co):
    """A layer's fused launch (``ops/conv/products_kernels.py``) and, with
    ``MMSEG_GF_FUSED_PRODUCTS=0``, its batched GEMMs, tap sum and spread
    give the gradients of docs/gradient_filter.md to float64 rounding,
    with more channels than one tile holds: dense (70 in, 72 out),
    depthwise (70), two groups (35 in, 36 out each), and a depthwise conv
    with 6 outputs per channel (BiSeNet's gather-and-expand layers);
    patches that leave pixels uncovered included (a 3x3 kernel without
    padding: ``Q(0)`` starts at pixel 1; those pixels get 0)."""
    from mmseg_gf.ops.backend import switches
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, ci, 7, 9, generator=gen, dtype=torch.float64)
    w = torch.randn(co, ci // groups, kernel, kernel, generator=gen,
                    dtype=torch.float64)
    b = torch.randn(co, generator=gen, dtype=torch.float64)
    results = {}
    for fused in (True, False):
        with switches.override(MMSEG_GF_FUSED_PRODUCTS=fused):
            calls = conv_gpu.backward_calls()
            _, grad_out, results[fused] = _filtered(
                x, w, b, stride, padding, groups, 2, _randn_like(4))
            assert conv_gpu.backward_calls() == calls + 1
    want = reference_gradients(x, w, grad_out.cpu(), (stride, stride),
                               (padding, padding), (1, 1), groups, 2)
    for fused, got in results.items():
        for g, r in zip(got, want):
            assert g.shape == r.shape and g.dtype == r.dtype
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f'fused={fused}: {m}')
    if padding == 0 and kernel == 3:
        assert (results[True][0][:, :, 0] == 0).all()  # outside Q(P)


def _wall_clock_bench(timed: list):
    """A ``do_bench`` for ``triton.autotune`` that any device runs (the
    interpreter has no CUDA events): one call's wall time in ms, each
    call recorded in ``timed``."""
    import time

    def bench(fn, quantiles=None):
        if DEVICE != 'cpu':
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if DEVICE != 'cpu':
            torch.cuda.synchronize()
        timed.append(fn)
        ms = (time.perf_counter() - start) * 1e3
        return [ms] * len(quantiles) if quantiles else ms

    return bench


@pytest.mark.parametrize('kernel,stride,padding,groups,ci,co,timed_tiles', [
    (3, 1, 0, 1, 40, 36, 2), (3, 2, 1, 40, 40, 40, 2),
    # 20 channels a group: the 64-wide tiles are pruned, one left untimed
    (1, 2, 0, 2, 40, 36, 0)])
def test_autotuned_kernels_give_the_filtered_gradients(kernel, stride,
                                                       padding, groups, ci,
                                                       co, timed_tiles):
    """The passes over ``x`` and ``g_y`` and the products launched through
    ``triton.autotune`` (two configs each, timed by the wall clock) give
    docs/gradient_filter.md's gradients to float64 rounding, dense,
    depthwise and grouped, with more channels than the small tiles hold;
    each config is timed once for a shape new to its kernel, none for a
    shape seen before; tiles much wider than the layer are not timed."""
    from mmseg_gf.ops.conv import kernels as triton_kernels
    from mmseg_gf.ops.conv import products_kernels as triton_products
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, ci, 7, 9, generator=gen, dtype=torch.float64)
    w = torch.randn(co, ci // groups, kernel, kernel, generator=gen,
                    dtype=torch.float64)
    b = torch.randn(co, generator=gen, dtype=torch.float64)
    timed = {'products': [], 'reduce': []}
    products = triton_products.tuned(
        triton_products.tuning_configs([(32, 32, 32, 32, 32, 16, 4),
                                        (64, 64, 64, 64, 64, 16, 8)]),
        do_bench=_wall_clock_bench(timed['products']))
    reduce = triton_kernels.tuned_reduce(
        [triton.Config({}, num_warps=w) for w in (2, 4)],
        do_bench=_wall_clock_bench(timed['reduce']))
    with triton_products.PRODUCTS_TUNING.using(products), \
            triton_kernels.REDUCE_TUNING.using(reduce):
        _, grad_out, got = _filtered(x, w, b, stride, padding, groups, 2,
                                     _randn_like(6))
        # x's patch sums and g_y's means: two keys of the pass
        assert [len(t) for t in timed.values()] == [timed_tiles, 4]
        assert (len(products.cache), len(reduce.cache)) == (1, 2)
        _filtered(x, w, b, stride, padding, groups, 2, _randn_like(7))
        assert [len(t) for t in timed.values()] == [timed_tiles, 4]
    want = reference_gradients(x, w, grad_out.cpu(), (stride, stride),
                               (padding, padding), (1, 1), groups, 2)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
