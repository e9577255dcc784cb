"""Optional compiled CPU kernels: the two full-size passes, and the whole
backward of the usual (non-dilated) conv in one call.

``setup.py`` builds ``mmseg_gf._patch_ops`` from the sources in ``csrc/``
when torch is importable at install time. Without it (or with
``MMSEG_GF_NATIVE=0`` in the environment) everything runs on the
pure-PyTorch path, which computes the same numbers; the kernels only make
the patch sums of ``g_y`` / ``x``, the spread of ``g_x`` and (fused) the
small-layer backward faster on CPU.

Outputs of 128 KiB or more (``g_x``, patch grids, and the lean region's
backward outputs through :func:`empty_for_writing`) are recycled: when such
a tensor dies its memory goes back to a small pool and the next output of
the same byte size reuses it, so a training step does not pay the page
faults of fresh memory again (see ``csrc/output_recycler.cpp``).
The pool holds at most ``MMSEG_GF_RECYCLE_MB`` MiB (default 256, ``0``
turns it off; a ``process_mib`` budget on CPU turns it off, as no
prediction counts its blocks); :func:`release_recycled` empties it.

Patches along an axis: patch ``P`` covers pixels ``[start + P*size,
start + (P+1)*size)`` clipped to the map; pixels outside count as zeros.

Under ``torch.compile`` the filtered conv's kernels (:func:`patch_sums`,
:func:`spread`, :func:`collapsed_backward`) are called as registered
operators (``torch.library``, with fake implementations), so the compiled
graph runs them as eager mode does; in eager mode they are called
directly, without the dispatcher's round trip.
"""
import contextlib
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import switches

#: The compiled modules setup.py builds, each with what it makes faster.
KERNELS = {
    '_patch_ops': 'the filtered convs and Linears',
    '_bit_mask': "the lean region's bit masks",
    '_resized_loss': 'the loss on upsampled logits',
}
#: module name -> why it did not import (:func:`kernel_missing`).
_missing: Dict[str, str] = {}
_warned = False


class KernelsMissingWarning(UserWarning):
    """The compiled CPU kernels are not built: the PyTorch path runs."""


def kernel_missing(name: str, error: ImportError) -> None:
    """Record that the compiled module ``mmseg_gf.<name>`` did not import
    (its loader then takes the PyTorch path), for
    :func:`warn_if_kernels_missing`."""
    _missing[name] = str(error)


def missing_kernels() -> Dict[str, str]:
    """The compiled modules that did not import, each with its error."""
    return dict(_missing)


def warn_if_kernels_missing() -> bool:
    """Warn once per process (:class:`KernelsMissingWarning`) where a
    compiled module is missing, naming the slower path and how to build
    them; silent where they are off on purpose (``MMSEG_GF_NATIVE=0`` or
    ``MMSEG_GF_BUILD_NATIVE=0``). Returns whether it warned. The package's
    import calls it, once every loader has run."""
    global _warned
    if _warned or not _missing or not switches.value('MMSEG_GF_NATIVE') \
            or not switches.value('MMSEG_GF_BUILD_NATIVE'):
        return False
    _warned = True
    names = ', '.join(f'mmseg_gf.{name} ({KERNELS[name]})'
                      for name in _missing)
    warnings.warn(
        f'mmseg_gf: compiled CPU kernels not built: {names}; the slower '
        'pure-PyTorch path runs (same results). Build them where torch is '
        'installed: `pip install --no-build-isolation --no-deps -e .` in '
        'the repository (or `python setup.py build_ext --inplace`). '
        'MMSEG_GF_NATIVE=0 or MMSEG_GF_BUILD_NATIVE=0 silences this. '
        f'Import error: {next(iter(_missing.values()))}',
        KernelsMissingWarning, stacklevel=2)
    return True


try:
    from ... import _patch_ops as _kernels
except ImportError as _error:  # not built: pure-PyTorch path
    _kernels = None
    kernel_missing('_patch_ops', _error)

__all__ = [
    'KERNELS', 'KernelsMissingWarning', 'kernel_missing', 'missing_kernels',
    'warn_if_kernels_missing', 'available', 'usable', 'patch_sums', 'spread', 'collapsed_backward',
    'filtered_conv2d', 'fused_backward_calls',
    'built', 'recycle_limit', 'recycled_bytes', 'release_recycled',
    'recycling_off',
    'empty_for_writing', 'bilinear_backward', 'token_rows_usable',
    'token_patch_sums', 'token_filtered_backward',
    'token_rows_avx512_enabled', 'set_token_rows_avx512',
    'onednn_products_preferred', 'set_onednn_products'
]

Patches = Tuple[int, int, int]  # (start, size, count) along one axis


def built() -> bool:
    """True if the compiled kernels are built (switched off or not: their
    output pool exists either way)."""
    return _kernels is not None


def available() -> bool:
    """True if the compiled kernels are built and not switched off."""
    return _kernels is not None and switches.value('MMSEG_GF_NATIVE')


def usable(t: Tensor) -> bool:
    """The kernels take non-empty contiguous NCHW float32 / float64 CPU
    tensors (every compiled entry point refuses other tensors with a
    RuntimeError); under ``torch.compile`` through their operators."""
    return (available() and t.device.type == 'cpu'
            and t.dtype in (torch.float32, torch.float64) and t.dim() == 4
            and t.numel() > 0 and t.is_contiguous())


@torch.library.custom_op('mmseg_gf::native_patch_sums', mutates_args=())
def _patch_sums_op(t: Tensor, rows: List[int], cols: List[int],
                   channel_major: bool) -> Tensor:
    return _kernels.patch_sums(t, *rows, *cols, channel_major)


@_patch_sums_op.register_fake
def _(t, rows, cols, channel_major):
    n, c = t.shape[:2]
    if channel_major:
        return t.new_empty((c, n, rows[2], cols[2])).permute(1, 0, 2, 3)
    return t.new_empty((n, c, rows[2], cols[2]))


@torch.library.custom_op('mmseg_gf::native_spread', mutates_args=())
def _spread_op(grid: Tensor, height: int, width: int, rows: List[int],
               cols: List[int]) -> Tensor:
    return _kernels.spread(grid, height, width, rows[0], rows[1], cols[0],
                           cols[1])


@_spread_op.register_fake
def _(grid, height, width, rows, cols):
    return grid.new_empty((grid.shape[0], grid.shape[1], height, width))


@torch.library.custom_op('mmseg_gf::native_collapsed_backward',
                         mutates_args=())
def _collapsed_backward_op(grad_output: Tensor, input_pooled: Optional[Tensor],
                           weight: Tensor, groups: int, scale: float,
                           input_size: List[int], rows: List[int],
                           cols: List[int], radius: int, need_input: bool,
                           need_weight: bool, need_bias: bool
                           ) -> Tuple[Tensor, Tensor, Tensor]:
    # an operator returns no None: an empty tensor stands for each
    # gradient not asked for
    return tuple(grad_output.new_empty(0) if g is None else g
                 for g in _kernels.collapsed_backward(
                     grad_output, input_pooled, weight, groups, scale,
                     *input_size, rows[0], rows[1], cols[0], cols[1],
                     radius, need_input, need_weight, need_bias))


@_collapsed_backward_op.register_fake
def _(grad_output, input_pooled, weight, groups, scale, input_size, rows,
      cols, radius, need_input, need_weight, need_bias):
    co, ci_g = weight.shape[:2]
    n = grad_output.shape[0]
    shapes = ((n, ci_g * groups, *input_size), (co, ci_g, 1, 1), (co, ))
    return tuple(grad_output.new_empty(shape if need else (0, ))
                 for shape, need in zip(shapes, (need_input, need_weight,
                                                 need_bias)))


def patch_sums(t: Tensor, rows: Patches, cols: Patches,
               channel_major: bool = False) -> Tensor:
    """``N x C x rows.count x cols.count`` sums of ``t`` over its patches.

    With ``channel_major`` the result's memory is ``C x N x ...`` (a
    permuted view): the layout :func:`collapsed_backward` multiplies
    without a copy.
    """
    if torch.compiler.is_compiling():
        return _patch_sums_op(t, list(rows), list(cols), channel_major)
    return _kernels.patch_sums(t, *rows, *cols, channel_major)


def spread(grid: Tensor, height: int, width: int, rows: Patches,
           cols: Patches) -> Tensor:
    """Each cell of ``grid`` broadcast over its patch of a ``height x
    width`` map (zeros outside every patch)."""
    if torch.compiler.is_compiling():
        return _spread_op(grid, height, width, list(rows), list(cols))
    return _kernels.spread(grid, height, width, rows[0], rows[1], cols[0],
                           cols[1])


def collapsed_backward(grad_output: Tensor, input_pooled: Optional[Tensor],
                       weight: Tensor, groups: int, scale: float,
                       input_size: Tuple[int, int], rows: Patches,
                       cols: Patches, radius: int, need_input: bool,
                       need_weight: bool, need_bias: bool
                       ) -> Tuple[Optional[Tensor], Optional[Tensor],
                                  Optional[Tensor]]:
    """The whole backward of a conv whose kernel collapses on both axes.

    ``rows`` / ``cols`` are the input patches ``Q(P)``; ``grad_output``
    and ``weight`` are ``usable`` tensors of one dtype. Returns ``(g_x,
    g_W, g_b)``, ``None`` where not asked for; ``g_W`` is on the pooled
    ``Co x Ci/groups x 1 x 1`` kernel.
    """
    if torch.compiler.is_compiling():
        # The kernel reads the weight only for its taps' sum W~ (its g_W
        # is on the 1 x 1 pooled kernel): W~ summed in the graph, where it
        # reads the weight at the strides the graph keeps it in (Inductor
        # lays out conv weights channels-last; the operator would take a
        # contiguous copy of the whole weight first)
        kernel = (weight if weight[0, 0].numel() == 1 else
                  weight.sum(dim=(2, 3), keepdim=True))
        grads = _collapsed_backward_op(
            grad_output, input_pooled, kernel, groups, scale,
            list(input_size), list(rows), list(cols), radius, need_input,
            need_weight, need_bias)
        return tuple(g if need else None for g, need in
                     zip(grads, (need_input, need_weight, need_bias)))
    return tuple(
        _kernels.collapsed_backward(grad_output, input_pooled, weight, groups,
                                    scale, *input_size, rows[0], rows[1],
                                    cols[0], cols[1], radius, need_input,
                                    need_weight, need_bias))


def filtered_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                    stride: Tuple[int, int], padding: Tuple[int, int],
                    dilation: Tuple[int, int], groups: int, radius: int,
                    rows: Patches, cols: Patches) -> Tensor:
    """``F.conv2d`` whose backward is :func:`collapsed_backward`, as one
    C++ autograd node (no Python runs in its backward).

    ``x`` is ``usable``, ``weight`` / ``bias`` of its dtype, and the kernel
    collapses on both axes; ``rows`` / ``cols`` are the input patches
    ``Q(P)`` (their counts are implied by the output size and ``radius``).
    """
    return _kernels.filtered_conv2d(x, weight, bias, list(stride),
                                    list(padding), list(dilation), groups,
                                    radius, rows[0], rows[1], cols[0],
                                    cols[1])


def fused_backward_calls() -> int:
    """How many backward calls have run :func:`collapsed_backward` in this
    process, from either autograd path (a diagnostic)."""
    return _kernels.fused_backward_calls()


def onednn_products_preferred() -> bool:
    """Whether this CPU was measured to run the fused backward's large
    float32 products faster as oneDNN convolutions than as MKL GEMMs: AMD
    CPUs with full-width AVX-512 (Zen 5 and later), which MKL does not use
    (see ``csrc/cpu_dispatch.cpp``). The default setting."""
    return _kernels.onednn_products_preferred()


def set_onednn_products(enabled: bool) -> bool:
    """Let large float32 products run on oneDNN (``True``) or always on
    MKL (``False``); returns the previous setting. The filtered Linear's
    CPU backward follows it too: its input-gradient product on oneDNN's
    inner product, its weight-gradient product in its own AVX-512 code
    (``csrc/token_rows_avx512.cpp``, with :func:`set_token_rows_avx512`
    on)."""
    return _kernels.set_onednn_products(bool(enabled))


def empty_for_writing(shape, like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` in ``like``'s dtype
    and device, for an output written in full: on CPU with the kernels
    built, a recycled block when one of its byte size is kept (no page
    faults of fresh memory; the lean region's backward outputs use it as
    the filtered convs' do), else ``torch.empty``."""
    if not available() or like.device.type != 'cpu' or \
            torch.compiler.is_compiling():
        return like.new_empty(shape)
    return _kernels.empty_for_writing([int(v) for v in shape], like.dtype)


def bilinear_backward(grad: Tensor, out: Tensor, align_corners: bool,
                      scales: Tuple[Optional[float], Optional[float]]
                      ) -> Tensor:
    """torch's ``upsample_bilinear2d_backward`` of ``grad`` (each image
    contiguous, float32 / float64 CPU) into ``out`` (contiguous, the
    input's shape), one axis at a time (``csrc/bilinear_backward.cpp``: the
    same terms summed in another order); returns ``out``. Under
    ``torch.compile`` :func:`~.resize.bilinear_backward_op` calls it."""
    _kernels.bilinear_backward(grad, out, bool(align_corners),
                               *(-1.0 if s is None else float(s)
                                 for s in scales))
    return out


#: Bytes of patch means and ``g_x~`` that :func:`token_filtered_backward`
#: holds per chunk of patch rows: both stay in the L2 cache (1-2 MiB per
#: core on current x86 CPUs) between the pooling, the GEMMs and the spread.
TOKEN_CHUNK_BYTES = 1 << 20

#: A ``g_x`` of this many bytes or more is written with non-temporal
#: stores: it does not fit the caches anyway, and streaming stores skip the
#: read of every cache line before its write.
TOKEN_STREAM_BYTES = 16 << 20


def token_rows_usable(*tensors: Optional[Tensor]) -> bool:
    """The token-grid kernels take ``L x H x W x C`` token rows (any
    strides but a channel stride of 1) and matrices: CPU tensors of one
    dtype, float32 or float64, in eager mode; ``None`` entries are skipped.
    """
    if not available() or not hasattr(_kernels, 'token_filtered_backward') \
            or torch.compiler.is_compiling():
        return False
    given = [t for t in tensors if t is not None]
    dtype = given[0].dtype
    return dtype in (torch.float32, torch.float64) and all(
        t.device.type == 'cpu' and t.dtype == dtype and
        (t.shape[-1] <= 1 or t.stride(-1) == 1) for t in given)


def token_patch_sums(rows: Tensor, radius: int) -> Tensor:
    """Sums of ``rows`` (``L x H x W x C`` token rows) over every ``r x r``
    patch, ``L x ceil(H/r) x ceil(W/r) x C``, contiguous (partial border
    patches: over their tokens); one read of ``rows``
    (``csrc/token_grid_backward.cpp``)."""
    return _kernels.token_patch_sums(rows, int(radius))


def token_filtered_backward(grad_rows: Tensor, x_sums: Optional[Tensor],
                            weight: Tensor, grad_x_rows: Optional[Tensor],
                            radius: int, need_weight: bool, need_bias: bool
                            ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The filtered backward of a Linear's grid tokens in one call.

    ``grad_rows``: ``g_y``'s grid tokens as ``L x H x W x Co`` token rows;
    ``x_sums``: the forward's patch sums of ``x``, contiguous ``L x Ph x Pw
    x Ci`` (for ``g_W``); ``grad_x_rows``: where ``g_x``'s grid tokens are
    written (``L x H x W x Ci`` token rows), or None. Returns ``(g_W,
    g_b)``, None where not asked for; every tensor of one dtype.
    """
    grad_w, grad_b = _kernels.token_filtered_backward(
        grad_rows, x_sums, weight, grad_x_rows, int(radius),
        bool(need_weight), bool(need_bias), int(TOKEN_CHUNK_BYTES),
        int(TOKEN_STREAM_BYTES))
    return grad_w, grad_b


def token_rows_avx512_enabled() -> bool:
    """Whether the token-grid kernels pool ``g_y`` and spread ``g_x`` of
    float32 rows with AVX-512 (``csrc/token_rows_avx512.cpp``: the same
    sums as the portable loops, about one read of ``g_y`` instead of two to
    three at 128+ channels): CPUs with AVX-512F, unless switched off."""
    return _kernels.token_rows_avx512_enabled()


def set_token_rows_avx512(enabled: bool) -> bool:
    """Switch the AVX-512 token-row passes off (``False``: the portable
    loops) or back on; returns the previous setting."""
    return _kernels.set_token_rows_avx512(bool(enabled))


def recycle_limit(limit_bytes: int) -> int:
    """Set how many bytes of freed large outputs are kept for reuse (``0``:
    none, freeing what is kept); returns the previous limit."""
    return _kernels.recycle_limit(int(limit_bytes))


def recycled_bytes() -> int:
    """Bytes of freed large outputs kept for reuse right now."""
    return _kernels.recycled_bytes()


def release_recycled() -> None:
    """Free every kept output block (as ``torch.cuda.empty_cache`` does)."""
    _kernels.release_recycled()


@contextlib.contextmanager
def recycling_off():
    """Every large output in the block is fresh memory, as torch allocates
    it, and nothing is kept; the previous limit is restored afterwards.
    Memory profilers that count allocations need this: a recycled block was
    allocated once, in an earlier step. A no-op without the kernels."""
    if _kernels is None:
        yield
        return
    previous = recycle_limit(0)
    try:
        yield
    finally:
        recycle_limit(previous)


def _applier(setter, to_kernel=lambda value: value):
    """:func:`switches.override`'s way to a toggle kept in the compiled
    kernels: ``setter`` (which returns the previous state) takes the value,
    and the previous state, as the kernels hold it, is put back. Without
    the kernels nothing reads the toggle, so there is nothing to set."""

    def apply(value):
        if _kernels is None:
            return lambda: None
        previous = setter(to_kernel(value))
        return lambda: setter(previous)

    return apply


switches.bind_applier('MMSEG_GF_RECYCLE_MB',
                      _applier(recycle_limit, lambda mib: mib << 20))
switches.bind_applier('onednn_products', _applier(set_onednn_products))
switches.bind_applier('token_rows_avx512', _applier(set_token_rows_avx512))
