"""``GFMultiheadAttention``: ``nn.MultiheadAttention`` with gradient-filtered
in- and out-projections on token grids (docs/gradient_filter.md, section
"Linear layers on token grids").

Torch's attention calls ``F.linear`` on its packed weights, never its
``out_proj`` module, so this class reruns ``F.multi_head_attention_forward``
op for op (bit for bit, tested) with filtered projections."""

import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import check_radius
from ..ops.linear.function import gradient_filtered_linear
from ..patching import plain_class
from .filtered_layer import FilteredLayer
from .gf_conv import warn_exact_backward
from .gf_linear import TokenGridSource
from .lean_transformer import AttentionCall
from .trained import trains


class ProbabilitiesCall(NamedTuple):
    """What a ``bmm``-path call (``need_weights=True``) kept besides its
    projections, as shapes."""

    batch: int
    num_heads: int
    q_len: int
    kv_len: int
    dim: int
    elem_bytes: int
    dropout: bool


def is_filterable_attention(module: nn.Module) -> bool:
    """True for ``nn.MultiheadAttention`` itself (and GFMultiheadAttention):
    a subclass may change the computation this class reproduces."""
    plain = plain_class(module)
    return plain is nn.MultiheadAttention or isinstance(
        module, GFMultiheadAttention)


def _stored_rows(t: Tensor) -> Optional[Tensor]:
    """``t`` (``(N, B, C)``) as a view ``F.linear`` reads as rows without a
    copy (itself or its batch-first transpose), else None."""
    for view in (t, t.transpose(0, 1)):
        try:
            view.view(-1, view.shape[-1])
            return view
        except RuntimeError:
            continue
    return None


def _exact_inputs(*tensors: Tensor
                  ) -> Tuple[Tuple[int, int, bool, bool], ...]:
    """``(storage address, bytes, shared, requires_grad)`` of each distinct
    input of the exact projections: addresses only, so the record does not
    keep tensors alive after the step."""
    out, seen = [], set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        shared = _stored_rows(t) is not None
        out.append((storage.data_ptr(),
                    storage.nbytes() if shared else t.numel() *
                    t.element_size(), shared, t.requires_grad))
    return tuple(out)


class GFMultiheadAttention(FilteredLayer, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with gradient-filtered projections.

    Filters the calls it reproduces exactly (packed weights, no
    ``bias_k``/``bias_v``/``add_zero_attn``, no masks: mmseg's MiT, Twins and
    ViT); other calls and unknown grids run torch's forward with the exact
    backward and warn once (:class:`GFExactBackwardWarning`; silent with
    ``enabled=False``). Without needed weights and without dropout on them it
    runs SDPA and keeps no ``L x S`` probabilities. Built by
    :meth:`from_attention`; its ``state_dict`` is ``nn.MultiheadAttention``'s.
    """

    radius: int
    enabled: bool
    query_source: Optional[TokenGridSource]
    key_source: Optional[TokenGridSource]
    #: set by mmcv's wrapper, made lean, around a call whose weights it
    #: discards (:mod:`.lean_transformer`)
    _gf_lean_weights_unused = False

    @classmethod
    def from_attention(cls, attention: nn.MultiheadAttention, radius: int,
                       query_source: Optional[TokenGridSource],
                       key_source: Optional[TokenGridSource] = None,
                       enabled: bool = True) -> 'GFMultiheadAttention':
        """Wrap ``attention``, sharing its Parameters and ``out_proj``.

        ``key_source`` defaults to ``query_source`` (self-attention);
        ``enabled=False`` gives the exact backward.
        """
        if not is_filterable_attention(attention):
            raise TypeError(
                f'cannot gradient-filter a {type(attention).__module__}.'
                f'{type(attention).__name__}: only nn.MultiheadAttention\'s '
                'own forward is reproduced')
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name, value in vars(attention).items():
            if not name.startswith('_') or name == '_qkv_same_embed_dim':
                setattr(new, name, value)
        for name, param in attention._parameters.items():
            new.register_parameter(name, param)
        for name, module in attention._modules.items():
            new.add_module(name, module)
        new.radius = check_radius(radius)
        new.enabled = bool(enabled)
        new.query_source = query_source
        new.key_source = query_source if key_source is None else key_source
        return new

    def _unsupported(self, query: Tensor, key: Tensor, value: Tensor,
                     key_padding_mask, attn_mask, is_causal) -> Optional[str]:
        if not self._qkv_same_embed_dim:
            return 'separate q/k/v projection weights (kdim/vdim)'
        if self.bias_k is not None or self.add_zero_attn:
            return 'bias_k / bias_v / add_zero_attn'
        if attn_mask is not None or key_padding_mask is not None \
                or is_causal:
            return 'attention masks'
        if query.dim() not in (2, 3) or key.shape != value.shape \
                or key.dim() != query.dim():
            return 'inputs of unexpected shapes'
        if self.enabled and (self.query_source is None
                             or self.query_source.grid is None
                             or self.key_source.grid is None):
            return ('no token grid is known for this call (grid sources '
                    f'{self.query_source!r}, {self.key_source!r})')
        return None

    def forward(self,
                query: Tensor,
                key: Tensor,
                value: Tensor,
                key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True,
                attn_mask: Optional[Tensor] = None,
                average_attn_weights: bool = True,
                is_causal: bool = False
                ) -> Tuple[Tensor, Optional[Tensor]]:
        args = (query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal)
        # this call's records, plain attributes (no Module.__setattr__)
        vars(self).update(_gf_lean_call=None, _gf_probabilities_call=None,
                          _exact_inputs=(), _packing=None,
                          _out_rows_copied=True)
        if not (torch.is_grad_enabled() and
                (query.requires_grad or key.requires_grad
                 or value.requires_grad or trains(self))):
            return super().forward(*args)
        reason = self._unsupported(query, key, value, key_padding_mask,
                                   attn_mask, is_causal)
        sdpa = self._sdpa_applies(need_weights)
        if not self.enabled and reason is not None:
            return super().forward(*args)  # exact: torch's own computation
        if reason is not None:
            warn_exact_backward(self, reason)
            return super().forward(*args)
        return self._filtered_forward(query, key, value, need_weights,
                                      average_attn_weights, sdpa)

    def _sdpa_applies(self, need_weights: bool) -> bool:
        """Whether SDPA applies: weights not asked for (or discarded by a lean
        mmcv wrapper) and no dropout on the probabilities."""
        if not need_weights:
            return True
        return bool(getattr(self, '_gf_lean_weights_unused', False)) and (
            self.dropout == 0 or not self.training)

    def _project(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                 source: TokenGridSource) -> Tensor:
        """One projection of ``(N, B, C)`` tokens: token axis 0 (exact
        with ``enabled=False``)."""
        if not self.enabled:
            # the rows in their stored order: F.linear then keeps a view of
            # the input at any batch, not a copy at some batches only
            rows = _stored_rows(x)
            if rows is not None and rows is not x:
                return F.linear(rows, weight, bias).transpose(0, 1)
            return F.linear(x, weight, bias)
        return gradient_filtered_linear(x, weight, bias, source.grid,
                                        self.radius, 0)

    def _in_projection(self, query: Tensor, key: Tensor,
                       value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``F._in_projection_packed``'s three cases, filtered."""
        w, b, e = self.in_proj_weight, self.in_proj_bias, query.size(-1)
        qs, ks = self.query_source, self.key_source
        if key is value:
            if query is key:  # self-attention: one packed projection
                proj = self._project(query, w, b, qs)
                proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(
                    0, -2).squeeze(-2).contiguous()
                return proj[0], proj[1], proj[2]
            w_q, w_kv = w.split([e, e * 2])
            b_q, b_kv = (None, None) if b is None else b.split([e, e * 2])
            q = self._project(query, w_q, b_q, qs)
            kv = self._project(key, w_kv, b_kv, ks)
            kv = kv.unflatten(-1, (2, e)).unsqueeze(0).transpose(
                0, -2).squeeze(-2).contiguous()
            return q, kv[0], kv[1]
        w_q, w_k, w_v = w.chunk(3)
        b_q = b_k = b_v = None
        if b is not None:
            b_q, b_k, b_v = b.chunk(3)
        return (self._project(query, w_q, b_q, qs),
                self._project(key, w_k, b_k, ks),
                self._project(value, w_v, b_v, ks))

    def _filtered_forward(self, query: Tensor, key: Tensor, value: Tensor,
                          need_weights: bool, average_attn_weights: bool,
                          sdpa: bool = False
                          ) -> Tuple[Tensor, Optional[Tensor]]:
        """Torch's slow-path forward (no masks) with filtered projections, op for
        op; ``sdpa``: through SDPA, equal up to the order of sums."""
        is_batched = query.dim() == 3
        query, key, value = self._sequence_first(query, key, value,
                                                 is_batched)
        tgt_len, bsz, embed_dim = query.shape
        self._packing = ('qkv' if query is key and key is value else
                         'kv' if key is value else 'separate')
        if not self.enabled:
            self._exact_inputs = _exact_inputs(query, key, value)
        heads = self.num_heads
        head_dim = embed_dim // heads
        q, k, v = self._in_projection(query, key, value)
        # (torch's views; a copy where an exact projection returned
        # batch-first rows)
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if not sdpa:
            out, weights = self._bmm_attention(q, k, v, bsz, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                weights = weights.squeeze(0)
        else:
            out = self._sdpa_attention(q, k, v, bsz, dropout_p)
        out = self._project(
            out.view(tgt_len, bsz, embed_dim), self.out_proj.weight,
            self.out_proj.bias, self.query_source)
        if not is_batched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(1, 0)
        return out, weights

    def _sequence_first(self, query: Tensor, key: Tensor, value: Tensor,
                        is_batched: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """The inputs as ``(L, N, E)``; tensors that were one object stay one
        (the in-projection's packing is read from their identity)."""
        if self.batch_first and is_batched:
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0)
                                     for x in (query, key, value))
        if not is_batched:
            query, key, value = (query.unsqueeze(1), key.unsqueeze(1),
                                 value.unsqueeze(1))
        return query, key, value

    def _bmm_attention(self, q: Tensor, k: Tensor, v: Tensor, bsz: int,
                       dropout_p: float) -> Tuple[Tensor, Tensor]:
        """torch's ``bmm`` path, op for op: output rows ``(L * N, E)`` and the
        weights ``(N, heads, L, S)``."""
        heads = self.num_heads
        tgt_len, src_len = q.size(1), k.size(1)
        embed_dim = heads * q.shape[-1]
        q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
        weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v)
        out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        self._gf_probabilities_call = ProbabilitiesCall(
            bsz, heads, tgt_len, src_len, embed_dim,
            q.element_size(), dropout_p > 0.0)
        return out, weights.view(bsz, heads, tgt_len, src_len)

    def _sdpa_attention(self, q: Tensor, k: Tensor, v: Tensor, bsz: int,
                        dropout_p: float) -> Tensor:
        """The attention through SDPA, its output as rows for the
        out-projection (viewing SDPA's output where it can, so both keep
        one storage)."""
        heads = self.num_heads
        tgt_len, src_len, head_dim = q.size(1), k.size(1), q.shape[-1]
        embed_dim = heads * head_dim
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, None, dropout_p,
                                             False)
        self._gf_lean_call = AttentionCall(
            bsz, bsz, tgt_len, src_len, embed_dim, heads,
            out.element_size(), 8 if out.dtype == torch.float64 else 4)
        if self.enabled:  # torch's order of rows (op for op)
            return out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        # batch-first rows, a view of SDPA's output where it holds them in
        # that order, whatever the batch
        rows = out.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        self._out_rows_copied = (rows.untyped_storage().data_ptr() !=
                                 out.untyped_storage().data_ptr())
        return rows.transpose(0, 1)

    def extra_repr(self) -> str:
        return (f'embed_dim={self.embed_dim}, num_heads={self.num_heads}, '
                f'radius={self.radius}'
                f'{"" if self.enabled else ", enabled=False"}')
