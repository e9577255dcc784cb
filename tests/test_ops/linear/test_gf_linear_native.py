"""The compiled token-grid kernels of the filtered Linear
(``csrc/token_grid_backward.cpp``) against the pure-PyTorch path of
``mmseg_gf.ops.linear.function`` (``MMSEG_GF_NATIVE=0``), which
tests/test_ops/linear/test_gf_linear.py checks against the float64 reference.

Both paths must agree for every layout, token axis, partial border patch,
extra / trailing tokens, chunking and store mode; float64 to 1e-12,
float32 to float32 rounding.
"""
import pytest
import torch
import torch.nn.functional as F

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from mmseg_gf.ops.backend import availability, cpu_settings, extension, output_pool
from mmseg_gf.ops.linear import cpu as linear_cpu
from mmseg_gf.ops.linear.token_grid import TokenLayout
from tests.helpers.devices import kernels_off
from tests.helpers.gf_linear_cases import LAYOUT_CASES

pytestmark = pytest.mark.skipif(
    not availability.native_available() or
    not hasattr(extension.module('patch_ops'), 'token_filtered_backward'),
    reason='compiled kernels not built (pip install --no-build-isolation -e .)')

# the layouts of test_gf_linear.py, with partial border patches at
# r = 2, 3, 4 on most of them
CASES = LAYOUT_CASES


def _inputs(shape, cout, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(cout, shape[-1], generator=gen,
                    dtype=torch.float64).to(dtype)
    b = torch.randn(cout, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(*shape[:-1], cout, generator=gen,
                    dtype=torch.float64).to(dtype)
    return x, w, b, g


def _grads(x, w, b, g, grid, radius, token_dim, with_x=True, bias=True):
    x = x.clone().requires_grad_(with_x)
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_() if bias else None
    y = gradient_filtered_linear(x, w, b, grid, radius, token_dim)
    inputs = [t for t in (x, w, b) if t is not None and t.requires_grad]
    return torch.autograd.grad(y, inputs, g)


def _both_paths(monkeypatch, *args, **kwargs):
    calls = []
    kernel = linear_cpu.token_filtered_backward

    def spy(*a, **k):
        calls.append(1)
        return kernel(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(linear_cpu, 'token_filtered_backward', spy)
        fast = _grads(*args, **kwargs)
    assert calls, 'the compiled backward did not run'
    with monkeypatch.context() as m, kernels_off():
        m.setattr(linear_cpu, 'token_filtered_backward', spy)
        calls.clear()
        slow = _grads(*args, **kwargs)
        assert not calls, 'MMSEG_GF_NATIVE=0 still ran the compiled backward'
    return fast, slow


@pytest.mark.parametrize('grid,shape,token_dim', CASES)
@pytest.mark.parametrize('radius', [1, 2, 3, 4, 8])
def test_float64_matches_pure_torch(monkeypatch, grid, shape, token_dim,
                                    radius):
    x, w, b, g = _inputs(shape, 4, torch.float64)
    fast, slow = _both_paths(monkeypatch, x, w, b, g, grid, radius,
                             token_dim)
    for a, e in zip(fast, slow):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('grid,shape,token_dim', CASES[:6])
@pytest.mark.parametrize('radius', [2, 3])
@pytest.mark.parametrize('with_x,bias', [(True, False), (False, True)])
def test_float32_and_cases_match_pure_torch(monkeypatch, grid, shape,
                                            token_dim, radius, with_x, bias):
    """float32, a frozen input (weight only) and no bias."""
    x, w, b, g = _inputs(shape, 6, torch.float32, seed=1)
    fast, slow = _both_paths(monkeypatch, x, w, b, g, grid, radius,
                             token_dim, with_x=with_x, bias=bias)
    assert len(fast) == len(slow) == int(with_x) + 1 + int(bias)
    for a, e in zip(fast, slow):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('chunk_bytes,stream_bytes', [(1, 0), (4096, 0),
                                                      (1 << 20, 1 << 40)])
def test_chunks_and_streaming_stores(monkeypatch, chunk_bytes, stream_bytes):
    """One patch row per chunk, a few, all in one; g_x written with
    non-temporal stores or plain ones: the same numbers."""
    grid = TokenGrid(9, 10, extra_tokens=1)  # partial patches at r = 2, 4
    x, w, b, g = _inputs((3, 91, 8), 12, torch.float64, seed=2)
    monkeypatch.setattr(linear_cpu, 'TOKEN_CHUNK_BYTES', chunk_bytes)
    monkeypatch.setattr(linear_cpu, 'TOKEN_STREAM_BYTES', stream_bytes)
    for radius in (2, 4):
        fast, slow = _both_paths(monkeypatch, x, w, b, g, grid, radius, 1)
        for a, e in zip(fast, slow):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_unaligned_channels_with_streaming_stores(monkeypatch):
    """Odd channel counts (tokens not 16-byte aligned) fall back to plain
    copies inside the streaming spread."""
    monkeypatch.setattr(linear_cpu, 'TOKEN_STREAM_BYTES', 0)
    grid = TokenGrid.windows(7)
    x, w, b, g = _inputs((4, 49, 3), 5, torch.float32, seed=3)
    fast, slow = _both_paths(monkeypatch, x, w, b, g, grid, 2, 1)
    for a, e in zip(fast, slow):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('grid,shape,token_dim', CASES)
@pytest.mark.parametrize('radius', [2, 3, 8])
def test_patch_sums_match_avg_pool(grid, shape, token_dim, radius):
    """The forward's patch sums of x (on strided views: extra tokens,
    (N, B, C)) equal the channels-last avg_pool2d of the PyTorch path."""
    x = torch.randn(shape, dtype=torch.float64)
    layout = TokenLayout(grid, radius, grid.token_axis(x.shape, token_dim))
    rows = layout.grid_view(x)
    rows = rows.reshape(-1, *rows.shape[-3:])
    got = linear_cpu.token_patch_sums(rows, radius)
    assert got.is_contiguous()
    torch.testing.assert_close(got, layout.pool_rows(rows, torch.float64),
                               rtol=1e-12, atol=1e-12)


def test_expanded_gradient_takes_the_pure_torch_path(monkeypatch):
    """A gradient with channel stride 0 (``y.sum().backward()``) is not
    kernel input: the PyTorch path runs, with the same numbers."""
    grid = TokenGrid(4, 4)
    x = torch.randn(2, 16, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    calls = []
    kernel = linear_cpu.token_filtered_backward
    monkeypatch.setattr(linear_cpu, 'token_filtered_backward',
                        lambda *a: calls.append(1) or kernel(*a))
    gradient_filtered_linear(x, w, None, grid, 2).sum().backward()
    assert not calls
    torch.testing.assert_close(x.grad, torch.ones(2, 16, 5) @ w.detach())


def test_forward_is_exact_and_grad_input_is_fully_written():
    """g_x lives in recycled memory: every token (grid and extra) must be
    written by the backward, whatever the block held before."""
    grid = TokenGrid(5, 6, extra_tokens=1, trailing_tokens=2)
    x, w, b, g = _inputs((2, 33, 4), 3, torch.float32, seed=4)
    for _ in range(3):  # the second and third g_x reuse the first's block
        x_ = x.clone().requires_grad_()
        y = gradient_filtered_linear(x_, w, b, grid, 2)
        assert torch.equal(y, F.linear(x_, w, b))
        output_pool.empty_for_writing(x.shape, x).fill_(float('nan'))
        (gx, ) = torch.autograd.grad(y, (x_, ), g)
        assert torch.isfinite(gx).all()


@pytest.mark.parametrize('call,match', [
    (lambda: extension.module('patch_ops').token_patch_sums(torch.randn(2, 3, 4), 2),
     'must be L x H x W x C token rows'),
    (lambda: extension.module('patch_ops').token_patch_sums(
        torch.randn(2, 3, 4, 5).transpose(2, 3), 2), 'channel'),
    (lambda: extension.module('patch_ops').token_patch_sums(
        torch.randn(1, 2, 2, 3, dtype=torch.float16), 2),
     'float32 or float64'),
    (lambda: extension.module('patch_ops').token_patch_sums(torch.randn(1, 2, 2, 3), 0),
     r'radius must be in \[1, 65536\], got 0'),
    (lambda: extension.module('patch_ops').token_patch_sums(torch.randn(1, 2, 2, 3),
                                              2**63 - 1),
     r'radius must be in \[1, 65536\], got 9223372036854775807'),
    (lambda: extension.module('patch_ops').token_filtered_backward(
        torch.randn(1, 4, 4, 3), None, torch.randn(5, 3), None, 2, False,
        True, 1 << 20, 0), 'Co = 3'),
    (lambda: extension.module('patch_ops').token_filtered_backward(
        torch.randn(1, 4, 4, 3), None, torch.randn(3, 2), None, 2, True,
        False, 1 << 20, 0), 'needs the patch sums of x'),
    (lambda: extension.module('patch_ops').token_filtered_backward(
        torch.randn(1, 4, 4, 3), torch.randn(1, 3, 2, 2),
        torch.randn(3, 2), None, 2, True, False, 1 << 20, 0),
     'x_sums must be a contiguous 1 x 2 x 2 x 2'),
    (lambda: extension.module('patch_ops').token_filtered_backward(
        torch.randn(1, 4, 4, 3), None, torch.randn(3, 2),
        torch.empty(1, 4, 5, 2), 2, False, False, 1 << 20, 0),
     'grad_x_rows must be 1 x 4 x 4 x 2'),
])
def test_kernels_refuse_bad_input(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


AVX512_CASES = [
    (TokenGrid(9, 10, extra_tokens=1), (2, 91, 48), 1, 37),
    (TokenGrid(6, 5, extra_tokens=1), (31, 2, 32), 0, 16),  # (N, B, C)
    (TokenGrid.windows(7), (3, 49, 96), 1, 40),
    (TokenGrid(4, 5, layout='hwc'), (2, 4, 5, 19), 1, 64),
]


@pytest.mark.skipif(
    not availability.native_available() or
    not hasattr(extension.module('patch_ops'), 'token_rows_avx512_enabled') or
    not cpu_settings.token_rows_avx512_enabled(),
    reason='no AVX-512 token-row passes on this CPU / build')
@pytest.mark.parametrize('grid,shape,token_dim,cout', AVX512_CASES)
@pytest.mark.parametrize('radius', [1, 2, 3, 4, 8])
@pytest.mark.parametrize('stream_bytes', [0, 1 << 40])
def test_avx512_rows_match_portable_loops(monkeypatch, grid, shape,
                                          token_dim, cout, radius,
                                          stream_bytes):
    """float32: the AVX-512 pooling and spread (csrc/token_rows_avx512.cpp)
    add the same tokens in the same order as the portable loops, so every
    gradient and the forward's patch sums are bit for bit the same; whole
    16-channel blocks and tails, strided token rows, partial patches,
    streaming and plain stores."""
    monkeypatch.setattr(linear_cpu, 'TOKEN_STREAM_BYTES', stream_bytes)
    x, w, b, g = _inputs(shape, cout, torch.float32, seed=4)
    layout = TokenLayout(grid, radius, grid.token_axis(x.shape, token_dim))
    results = {}
    # products on MKL for both: the AVX-512 weight-gradient product sums in
    # another order (test_products_on_avx512_only_where_allowed)
    products = cpu_settings.set_onednn_products(False)
    vectors = cpu_settings.set_token_rows_avx512(True)  # the previous setting
    try:
        for vector in (True, False):
            cpu_settings.set_token_rows_avx512(vector)
            results[vector] = (
                _grads(x, w, b, g, grid, radius, token_dim) +
                (layout.patch_sums(x, torch.float32), ))
    finally:
        cpu_settings.set_token_rows_avx512(vectors)
        cpu_settings.set_onednn_products(products)
    for a, e in zip(results[True], results[False]):
        assert torch.equal(a, e)


@pytest.mark.parametrize('shape,cout,radius,onednn', [
    ((2, 1024, 64), 80, 2, True),  # 512 patch cells x 80 x 64: oneDNN
    ((2, 1024, 64), 80, 2, False),  # MKL only
    ((2, 1024, 8), 8, 2, True),  # 512 x 8 x 8: too small for oneDNN
    ((2, 1024, 45), 83, 2, True),  # 8 x 32 blocks of g_W and their tails
])
def test_products_on_avx512_only_where_allowed(monkeypatch, shape, cout,
                                               radius, onednn):
    """Where float32 products may leave MKL (``set_onednn_products``), the
    input-gradient product runs on oneDNN's inner product from 2^21
    multiply-adds (csrc/cpu_dispatch.cpp: rows_times_matrix) and, with the
    AVX-512 token-row passes, the weight-gradient product on the kernel's
    own (csrc/token_rows_avx512.cpp); else both on MKL. Every float32
    gradient is within 2e-6 of its largest entry of the float64 pure-PyTorch
    gradients (512 patch cells summed: the float32 pure-PyTorch path itself
    is 3-4e-7 off)."""
    grid = TokenGrid(32, 32)
    x, w, b, g = _inputs(shape, cout, torch.float64, seed=5)
    large = (shape[0] * 32 * 32 // radius**2) * shape[-1] * cout >= 1 << 21
    previous = cpu_settings.set_onednn_products(onednn)
    try:
        with torch.profiler.profile() as prof:
            fast, slow = _both_paths(monkeypatch,
                                     *(t.float() for t in (x, w, b, g)),
                                     grid, radius, 1)
    finally:
        cpu_settings.set_onednn_products(previous)
    names = {event.name for event in prof.events()}
    assert ('mkldnn::_linear_pointwise' in names) == (onednn and large)
    with kernels_off():
        exact = _grads(x, w, b, g, grid, radius, 1)
    for got in (fast, slow):
        for a, e in zip(got, exact):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), e, rtol=0,
                                       atol=2e-6 * e.abs().max().item())
