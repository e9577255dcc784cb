"""Triton kernel of the resized cross-entropy: every per-pixel quantity of
one image's upsampled logits in one pass.

``_pixel_cross_entropy`` reads the upsampled logits and labels once and
writes the gradient ``w_p * (softmax - onehot)`` (or sigmoid), optionally
``ce_p`` and the label probability, and per-program partial sums (loss,
hits, labelled and bad labels); ``_batch_totals`` turns every image's
partial sums into the totals and mmseg's accuracy in one launch. The
PyTorch path takes about 15 launches and passes for the same. Float32
arithmetic: equal to it to rounding, the hits exactly (``argmax``'s
order). Importing this module imports ``triton``.
"""
import triton
import triton.language as tl
from torch import Tensor

from ..backend.triton_launch import LAUNCH_OPTIONS

#: The most classes one program holds per pixel (more: the PyTorch path).
MAX_CLASSES = 2048

# Elements per program tile. A heuristic, not tuned on a GPU: pixels are
# the fast axis (contiguous in an NCHW map), at least 16 per program; 8
# warps for a full tile (several tile-sized values are live at once).
_TILE = 4096


#: The tensor arguments each kernel writes (the others it reads): the
#: bytes a launch moves, for :mod:`mmseg_gf.accounting.launches`.
KERNEL_OUTPUTS = {'_pixel_cross_entropy': ('grad', 'loss_part', 'hits_part',
                                           'bad_part', 'valid_part',
                                           'pixel_loss', 'target_prob'),
                  '_batch_totals': ('loss', 'hits', 'loss_total',
                                    'hits_total', 'labelled', 'accuracy',
                                    'labels_bad')}

#: ``torch.finfo(torch.float32).eps``: mmseg's accuracy adds it.
_EPS = tl.constexpr(2.0 ** -23)  # a constexpr: a compiled kernel reads no other global


@triton.jit
def _pixel_cross_entropy(up, label, weight, grad, loss_part, hits_part,
                         bad_part, valid_part, pixel_loss, target_prob,
                         classes, pixels,
                         s_c, s_p, ignore_index, SIGMOID: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr, WANT_GRAD: tl.constexpr,
                         WANT_PIXELS: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    p = pid.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    p_ok = p < pixels
    c_ok = c < classes
    ok = c_ok[:, None] & p_ok[None, :]
    offs = c[:, None].to(tl.int64) * s_c + p[None, :] * s_p
    z = tl.load(up + offs, mask=ok, other=0.).to(tl.float32)
    t = tl.load(label + p, mask=p_ok, other=ignore_index)
    valid = p_ok & (t != ignore_index)
    safe = tl.where(valid, t, 0)
    onehot = (c[:, None] == safe[None, :]) & valid[None, :]
    w = valid.to(tl.float32)
    if HAS_WEIGHT:
        w = w * tl.load(weight + p, mask=p_ok, other=0.).to(tl.float32)
    ranked = tl.where(c_ok[:, None], z, -float('inf'))
    top = tl.argmax(ranked, axis=0, tie_break_left=True)
    # argmax's order: a NaN is the largest value, the first of equals wins
    nan = (z != z).to(tl.int32)
    top = tl.where(tl.max(nan, axis=0) > 0,
                   tl.argmax(nan, axis=0, tie_break_left=True), top)
    hit = valid & (top == safe)
    if SIGMOID:
        # torch's binary_cross_entropy_with_logits, per class, summed
        target = onehot.to(tl.float32)
        low = tl.maximum(-z, 0.)
        bce = (1. - target) * z + low + tl.log(tl.exp(-low) + tl.exp(-z - low))
        ce = tl.sum(tl.where(ok, bce, 0.), axis=0)
        g = 1. / (1. + tl.exp(-z)) - target
    else:
        top_value = tl.max(ranked, axis=0)
        e = tl.where(ok, tl.exp(ranked - top_value[None, :]), 0.)
        total = tl.where(p_ok, tl.sum(e, axis=0), 1.)  # (no log(0))
        label_logit = tl.sum(tl.where(onehot, z, 0.), axis=0)
        ce = tl.log(total) - (label_logit - top_value)
        prob = e / total[None, :]
        g = prob - onehot.to(tl.float32)
    ce = tl.where(valid, ce, 0.)
    tl.store(loss_part + pid, tl.sum(tl.where(valid, ce * w, 0.), axis=0))
    tl.store(hits_part + pid, tl.sum(hit.to(tl.int32), axis=0))
    bad = valid & ((t < 0) | (t >= classes))  # never read by index
    tl.store(bad_part + pid, tl.sum(bad.to(tl.int32), axis=0))
    tl.store(valid_part + pid, tl.sum(valid.to(tl.int32), axis=0))
    if WANT_GRAD:
        tl.store(grad + offs, (g * w[None, :]).to(grad.dtype.element_ty),
                 mask=ok)
    if WANT_PIXELS:
        tl.store(pixel_loss + p, ce.to(pixel_loss.dtype.element_ty),
                 mask=p_ok)
        if not SIGMOID:
            label_prob = tl.sum(tl.where(onehot, prob, 0.), axis=0)
            tl.store(target_prob + p,
                     label_prob.to(target_prob.dtype.element_ty), mask=p_ok)


def block_sizes(classes: int, pixels: int) -> dict:
    block_c = triton.next_power_of_2(max(classes, 1))
    block_p = max(16, _TILE // block_c)
    block_p = min(block_p, triton.next_power_of_2(max(pixels, 1)))
    return dict(BLOCK_C=block_c, BLOCK_P=block_p)


def programs(classes: int, pixels: int) -> int:
    return triton.cdiv(pixels, block_sizes(classes, pixels)['BLOCK_P'])


def pixel_cross_entropy(up: Tensor, label: Tensor, weight, grad, loss_part,
                        hits_part, bad_part, valid_part, pixel_loss,
                        target_prob, ignore_index: int,
                        sigmoid: bool) -> None:
    """One image: ``up`` ``1 x C x H x W`` (NCHW or channels-last), ``label``
    and the optional per-pixel tensors contiguous ``H x W``, ``grad`` like
    ``up`` (or None), and :func:`programs` partial sums.
    """
    classes = up.shape[1]
    pixels = up.shape[2] * up.shape[3]
    meta = block_sizes(classes, pixels)
    _pixel_cross_entropy[(triton.cdiv(pixels, meta['BLOCK_P']), )](
        up, label, label if weight is None else weight,
        up if grad is None else grad, loss_part, hits_part, bad_part,
        valid_part, loss_part if pixel_loss is None else pixel_loss,
        loss_part if target_prob is None else target_prob, classes, pixels,
        up.stride(1), up.stride(3), int(ignore_index),
        SIGMOID=bool(sigmoid), HAS_WEIGHT=weight is not None,
        WANT_GRAD=grad is not None, WANT_PIXELS=pixel_loss is not None,
        num_warps=8 if meta['BLOCK_C'] * meta['BLOCK_P'] >= _TILE else 4,
        **meta, **LAUNCH_OPTIONS)


@triton.jit
def _batch_totals(loss_part, hits_part, bad_part, valid_part, loss, hits,
                  loss_total, hits_total, labelled, accuracy, labels_bad,
                  images, parts, BLOCK: tl.constexpr):
    all_loss = tl.zeros((), tl.float64)
    all_hits = tl.zeros((), tl.int64)
    count = tl.zeros((), tl.int64)
    bad = tl.zeros((), tl.int32)
    for n in range(images):
        row_loss = tl.zeros((BLOCK, ), tl.float64)
        row_hits = tl.zeros((BLOCK, ), tl.int64)
        for start in range(0, parts, BLOCK):
            p = start + tl.arange(0, BLOCK)
            ok = p < parts
            offs = n * parts + p  # (N x programs < 2^31)
            row_loss += tl.load(loss_part + offs, mask=ok,
                                other=0.).to(tl.float64)
            row_hits += tl.load(hits_part + offs, mask=ok,
                                other=0).to(tl.int64)
            count += tl.sum(tl.load(valid_part + offs, mask=ok,
                                    other=0).to(tl.int64), axis=0)
            bad += tl.sum(tl.load(bad_part + offs, mask=ok, other=0),
                          axis=0)
        image_loss = tl.sum(row_loss, axis=0)
        image_hits = tl.sum(row_hits, axis=0)
        tl.store(loss + n, image_loss)
        tl.store(hits + n, image_hits)
        all_loss += image_loss
        all_hits += image_hits
    total_hits = all_hits.to(tl.float32)
    tl.store(loss_total, all_loss.to(loss_total.dtype.element_ty))
    tl.store(hits_total, total_hits)
    tl.store(labelled, count)
    # mmseg's accuracy as PyTorch rounds it: (hits + eps) in float32 times
    # float32(100 * (1 / (labelled + eps))), the factor in float64
    eps = tl.full((), _EPS, tl.float64)
    factor = (1.0 / (count.to(tl.float64) + eps)) * 100.0
    tl.store(accuracy, (total_hits + _EPS) * factor.to(tl.float32))
    tl.store(labels_bad, bad)


def batch_totals(loss_part: Tensor, hits_part: Tensor, bad_part: Tensor,
                 valid_part: Tensor, loss: Tensor, hits: Tensor,
                 loss_total: Tensor, hits_total: Tensor, labelled: Tensor,
                 accuracy: Tensor, labels_bad: Tensor) -> None:
    """The per-image and batch totals from :func:`pixel_cross_entropy`'s
    partial sums (``N x programs``) in one program, with the bad-label count
    and mmseg's accuracy (its eps, PyTorch's rounding).
    """
    images, parts = loss_part.shape
    _batch_totals[(1, )](
        loss_part, hits_part, bad_part, valid_part, loss, hits, loss_total,
        hits_total, labelled, accuracy, labels_bad, images, parts,
        BLOCK=min(1024, triton.next_power_of_2(parts)), **LAUNCH_OPTIONS)
