"""Lean variants of the frozen layers inside transformer blocks.

Mixins that :mod:`.lean` puts in front of a module's own class (docs/
lean_region.md, "Inside transformer blocks", lists what each keeps). Each
runs the plain forward when autograd does not record it or a condition
does not hold (trained parameters, masks, dropout on the probabilities,
unbatched inputs)."""
import functools
import importlib
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.lean.transformer import (BitMaskDropPathFunction,
                                    FrozenLayerNormFunction,
                                    multihead_attention)
from .trained import trains

__all__ = ['AttentionCall', 'transformer_kind', 'transformer_mixin',
           'mmcv_dropout_class', 'is_rule_owner', 'TRANSFORMER_KINDS',
           'KIND_MIXINS']

#: What :func:`transformer_kind` returns.
TRANSFORMER_KINDS = ('attention', 'layer_norm', 'drop_path')


class AttentionCall(NamedTuple):
    """What one lean attention call kept, as shapes (for the accounting; a
    named tuple: made at every call, in a fraction of a frozen dataclass's
    time).

    Attributes:
        batch: q's leading dimension (images, or images x windows).
        images: images in the call; None for a window attention without a
            per-window mask.
        mask_elements, mask_bytes: the additive mask SDPA keeps (0: none).
        output_storage: SDPA output's storage address (0: unknown), so an
            exact out-projection reading it is counted once."""

    batch: int
    images: Optional[int]
    q_len: int
    kv_len: int
    dim: int
    num_heads: int
    elem_bytes: int
    stat_bytes: int = 4
    mask_elements: int = 0
    mask_bytes: int = 4
    output_storage: int = 0


def _recording(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


def _core_recorded(attention: nn.Module, x: Tensor) -> bool:
    """Whether autograd records a window attention's own code (its input or
    its trained ``qkv`` needs a gradient)."""
    return _recording(x) or (torch.is_grad_enabled()
                             and trains(attention.qkv))


def _frozen(module: nn.Module) -> bool:
    return not trains(module)


def _stat_bytes(t: Tensor) -> int:
    # SDPA's logsumexp is float32 for float32 and reduced types, float64
    # for float64
    return 8 if t.dtype == torch.float64 else 4


class _LeanTorchAttention:
    """``nn.MultiheadAttention`` with frozen projections through SDPA."""

    #: set by mmcv's wrapper, made lean, around a call whose weights it
    #: discards (:class:`_LeanMmcvAttention`)
    _gf_lean_weights_unused = False

    def _lean_applies(self, query, key, value, key_padding_mask,
                      need_weights, attn_mask, is_causal) -> bool:
        return (_recording(query, key, value) and _frozen(self)
                and (not need_weights
                     or getattr(self, '_gf_lean_weights_unused', False))
                and key_padding_mask is None and attn_mask is None
                and not is_causal and self.bias_k is None
                and self.bias_v is None and not self.add_zero_attn
                and (self.dropout == 0 or not self.training)
                and query.dim() == key.dim() == value.dim() == 3)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True,
                attn_mask: Optional[Tensor] = None,
                average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, None]:
        if not self._lean_applies(query, key, value, key_padding_mask,
                                  need_weights, attn_mask, is_causal):
            self._gf_lean_call = None
            return super().forward(
                query, key, value, key_padding_mask=key_padding_mask,
                need_weights=need_weights, attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal)
        shared_kv = key is value
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1)
                                 for t in (query, key, value))
            if shared_kv:
                value = key
        e = self.embed_dim
        bias = self.in_proj_bias
        part = (lambda i: None) if bias is None else (
            lambda i: bias[i * e:(i + 1) * e])
        kv_proj = k_proj = v_proj = None
        if self._qkv_same_embed_dim:
            weight = self.in_proj_weight
            q_proj = (weight[:e], part(0))
            if shared_kv:
                kv_proj = (weight[e:], None if bias is None else bias[e:])
            else:
                k_proj = (weight[e:2 * e], part(1))
                v_proj = (weight[2 * e:], part(2))
        else:
            q_proj = (self.q_proj_weight, part(0))
            k_proj = (self.k_proj_weight, part(1))
            v_proj = (self.v_proj_weight, part(2))
        out = multihead_attention(
            query, key, value, self.num_heads, q_proj, kv_proj, k_proj,
            v_proj, (self.out_proj.weight, self.out_proj.bias))
        self._gf_lean_call = AttentionCall(
            query.shape[0], query.shape[0], query.shape[1], key.shape[1], e,
            self.num_heads, out.element_size(), _stat_bytes(out))
        return (out if self.batch_first else out.transpose(0, 1)), None


class _LeanMmcvAttention:
    """mmcv's ``MultiheadAttention`` and subclasses: it keeps only
    ``self.attn(...)[0]``, so it tells its inner attention that the
    probabilities are unused."""

    def forward(self, *args, **kwargs):
        attn = getattr(self, 'attn', None)
        if not hasattr(type(attn), '_gf_lean_weights_unused'):
            return super().forward(*args, **kwargs)
        attn._gf_lean_weights_unused = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            attn._gf_lean_weights_unused = False


def _sdpa_windows(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                  mask: Optional[Tensor], scale: float) -> Tensor:
    """``softmax(q k^T * scale + bias (+ mask)) v`` for windows. With a mask
    the windows go on the heads axis so SDPA keeps the mask once, not per
    image."""
    if mask is None:
        attn_mask = None if bias is None else bias.unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              scale=scale)
    b, h, n, d = q.shape
    n_win = mask.shape[0]
    attn_mask = mask.unsqueeze(1).to(q.dtype)
    if bias is not None:
        attn_mask = bias.unsqueeze(0) + attn_mask
    else:
        attn_mask = attn_mask.expand(n_win, h, n, n)
    images = b // n_win

    def by_image(t):
        return t.reshape(images, n_win * h, n, d)

    out = F.scaled_dot_product_attention(
        by_image(q), by_image(k), by_image(v),
        attn_mask=attn_mask.reshape(1, n_win * h, n, n), scale=scale)
    # CUDA's SDPA kernels may return the heads axis inner (a transposed
    # layout), which no view splits back into windows: reshape copies then.
    return out.reshape(b, h, n, d)


def _storage_address(t: Tensor) -> int:
    """``t``'s storage address, 0 while ``torch.compile`` traces (Dynamo does
    not trace ``untyped_storage``)."""
    if torch.compiler.is_compiling():
        return 0
    return t.untyped_storage().data_ptr()


class _LeanWindowMSA:
    """mmseg's Swin ``WindowMSA`` through SDPA: the relative position bias
    (frozen) and the shift mask are the additive mask."""

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if (not _core_recorded(self, x) or self.relative_position_bias_table
                .requires_grad or (self.training and self.attn_drop.p > 0)
                or x.dim() != 3 or (mask is not None
                                    and x.shape[0] % mask.shape[0])):
            self._gf_lean_call = None
            return super().forward(x, mask)
        b, n, c = x.shape
        h = self.num_heads
        qkv = self.qkv(x).reshape(b, n, 3, h, c // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        ws = self.window_size[0] * self.window_size[1]
        bias = self.relative_position_bias_table[
            self.relative_position_index.view(-1)].view(ws, ws, -1)
        bias = bias.permute(2, 0, 1).contiguous().to(q.dtype)
        out = _sdpa_windows(q, k, v, bias, mask, self.scale)
        n_win = 1 if mask is None else mask.shape[0]
        self._gf_lean_call = AttentionCall(
            b, None if mask is None else b // n_win, n, n, c, h,
            out.element_size(), _stat_bytes(out),
            mask_elements=n_win * h * n * n, mask_bytes=bias.element_size(),
            output_storage=_storage_address(out))
        x = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))


class _LeanLocallyGroupedAttention:
    """Twins' LSA through SDPA, its padding mask as the additive mask."""

    def forward(self, x: Tensor, hw_shape) -> Tensor:
        if (not _core_recorded(self, x)
                or (self.training and self.attn_drop.p > 0)
                or x.dim() != 3):
            self._gf_lean_call = None
            return super().forward(x, hw_shape)
        b, n, c = x.shape
        h, w = hw_shape
        ws = self.window_size
        x = x.view(b, h, w, c)
        pad_r = (ws - w % ws) % ws
        pad_b = (ws - h % ws) % ws
        x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        hp, wp = x.shape[1:-1]
        gh, gw = hp // ws, wp // ws
        # the mask as mmseg builds it (its `-0:` slices included)
        mask = torch.zeros((1, hp, wp), device=x.device)
        mask[:, -pad_b:, :].fill_(1)
        mask[:, :, -pad_r:].fill_(1)
        mask = mask.reshape(1, gh, ws, gw, ws).transpose(2, 3).reshape(
            gh * gw, ws * ws)
        attn_mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, -1000.0)
        x = x.reshape(b, gh, ws, gw, ws, c).transpose(2, 3)
        heads = self.num_heads
        qkv = self.qkv(x).reshape(b * gh * gw, ws * ws, 3, heads,
                                  c // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        # mmseg's mask is all zeros unless padding was added (its `-0:`
        # slices fill everything): then no mask is kept
        masked = bool(attn_mask.any())
        out = _sdpa_windows(q, k, v, None,
                            attn_mask.to(q.dtype) if masked else None,
                            self.scale)
        self._gf_lean_call = AttentionCall(
            b * gh * gw, b, ws * ws, ws * ws, c, heads, out.element_size(),
            _stat_bytes(out),
            mask_elements=gh * gw * heads * ws ** 4 if masked else 0,
            mask_bytes=q.element_size(),
            output_storage=_storage_address(out))
        out = out.transpose(1, 2).reshape(b, gh, gw, ws, ws, c)
        x = out.transpose(2, 3).reshape(b, gh * ws, gw * ws, c)
        if pad_r > 0 or pad_b > 0:
            x = x[:, :h, :w, :].contiguous()
        x = x.reshape(b, n, c)
        return self.proj_drop(self.proj(x))


class _LeanLayerNorm:
    """A frozen ``LayerNorm``: keeps its input and a per-token ``rstd``."""

    def forward(self, x: Tensor) -> Tensor:
        if not _recording(x) or not _frozen(self) or x.dim() < len(
                self.normalized_shape) + 1:
            return super().forward(x)
        return FrozenLayerNormFunction.apply(x, tuple(self.normalized_shape),
                                             self.weight, self.bias,
                                             float(self.eps))


class _LeanDropPath:
    """mmcv's ``DropPath`` keeping one bit per sample."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.drop_prob == 0 or not _recording(x):
            return super().forward(x)
        return BitMaskDropPathFunction.apply(x, float(self.drop_prob))


@functools.lru_cache(maxsize=16)  # keyed on the names in _mixins
def _optional(module: str, name: str) -> Optional[type]:
    """``module.name`` where that package is installed, else None."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


@functools.lru_cache(maxsize=1)
def _mixins() -> Tuple[Tuple[type, type, str], ...]:
    """``(plain class, mixin, kind)``, most specific first."""
    table = [(nn.LayerNorm, _LeanLayerNorm, 'layer_norm')]
    optional = [
        ('mmcv.cnn.bricks.transformer', 'MultiheadAttention',
         _LeanMmcvAttention, 'attention'),
        ('mmcv.cnn.bricks.drop', 'DropPath', _LeanDropPath, 'drop_path'),
        ('mmseg.models.backbones.swin', 'WindowMSA', _LeanWindowMSA,
         'attention'),
        ('mmseg.models.backbones.twins', 'LocallyGroupedSelfAttention',
         _LeanLocallyGroupedAttention, 'attention'),
    ]
    for module, name, mixin, kind in optional:
        cls = _optional(module, name)
        if cls is not None:
            table.append((cls, mixin, kind))
    return tuple(table)


def _entry(cls: type) -> Optional[Tuple[type, type, str]]:
    """The table's entry for ``cls``: its own class, or a subclass keeping the
    plain class's ``forward`` (a mixin would bypass a subclass's own)."""
    for entry in _mixins():
        base, mixin = entry[0], entry[1]
        if issubclass(cls, base) and (
                mixin is _LeanMmcvAttention or cls.forward is base.forward):
            return entry
    return None


def transformer_kind(plain: type) -> Optional[str]:
    """``'attention'``, ``'layer_norm'`` or ``'drop_path'`` for a class with a
    lean variant here, else None."""
    entry = _entry(plain)
    return None if entry is None else entry[2]


def transformer_mixin(plain: type) -> Optional[type]:
    """The mixin that makes ``plain`` lean (None: not one of these)."""
    entry = _entry(plain)
    return None if entry is None else entry[1]


def mmcv_dropout_class() -> Optional[type]:
    """mmcv's ``Dropout`` (``nn.Dropout`` with ``drop_prob``; None without
    mmcv): element-wise dropout, made lean as ``nn.Dropout``."""
    return _optional('mmcv.cnn.bricks.drop', 'Dropout')


def is_rule_owner(module: nn.Module) -> bool:
    """A module with children whose own code keeps tensors that an
    accounting rule counts: a lean attention (its SDPA call)."""
    return isinstance(module, _ATTENTIONS)


_ATTENTIONS = (_LeanTorchAttention, _LeanWindowMSA,
               _LeanLocallyGroupedAttention)

#: The lean variants here that a layer kind names for its frozen layers
#: (:attr:`~.layer_kinds.LayerKind.frozen_lean`): the attention's.
KIND_MIXINS = {'attention': _LeanTorchAttention}
