"""What trained layers on tokens keep for backward.

The rules of :mod:`.kept` for the token kinds
(:mod:`mmseg_gf.models.linear_kinds`) and for plain Linears on the gradient
path, per image, from the batch-1 trace; the table is in docs/cost.md,
section "Kept for backward, per module kind". Not modelled (measured): an
attention with dropout on its probabilities, and one running torch's own
forward (masks, ``kdim`` / ``vdim``).

Categories: a projection's tensors are ``'linear'``, Segmenter's class-score
Linears' ``'classifier'``, an attention's own tensors ``'attention'``.
Checked against autograd by ``tests/test_models/test_gf_attention_sdpa.py``
and ``tests/test_engine/test_token_kinds_accounting.py``.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..models.lean import is_lean, lean_kind
from ..models.linear_kinds import ATTENTION, LINEAR
from ..models.segmentor import is_class_score_layer
from ..ops.linear.token_grid import TokenGrid
from .kept import SavedItem, count_once
from .kept_transformer import attention_items

__all__ = ['token_items', 'patch_sum_elements', 'filtered_weight_views',
           'candidate_extra_items']


def patch_sum_elements(grid: TokenGrid, radius: int, numel: int,
                       channels: int) -> int:
    """Elements a filtered projection keeps of an input of ``numel``
    elements holding ``grid``'s tokens: the patch sums of the grid tokens
    and the tokens on no grid."""
    tokens = (grid.height * grid.width if grid.layout == 'hwc' else
              grid.num_tokens)
    lead = numel // (tokens * channels)
    ph, pw = grid.patch_grid(radius)
    extra = grid.extra_tokens + grid.trailing_tokens
    return lead * (ph * pw + extra) * channels


def _category(path: str) -> str:
    """``'classifier'`` for Segmenter's class-score Linears, else
    ``'linear'``."""
    return 'classifier' if is_class_score_layer(path) else 'linear'


def _once(path: str, category: str, ptr: int, nbytes: int, eb: int,
          shared: Dict[int, Tuple[str, Any]],
          storage: Any = None, rule: str = 'linear') -> List[SavedItem]:
    """One item of ``nbytes`` for storage ``ptr``, unless counted."""
    if not count_once(shared, path, ptr, storage):
        return []
    return [SavedItem(path, category, nbytes // eb, eb, rule, storage=ptr)]


def _weight_view(path: str, weight: torch.Tensor,
                 shared: Dict[int, Tuple[str, Any]]) -> List[SavedItem]:
    """A view of ``weight`` that ``F.linear`` keeps for ``g_x`` (a
    Parameter's storage: the same bytes at any batch)."""
    storage = weight.untyped_storage()
    return _once(path, _category(path), storage.data_ptr(),
                 storage.nbytes(), weight.element_size(), shared, storage,
                 'const')


def _input_rows(path: str, x: torch.Tensor,
                shared: Dict[int, Tuple[str, Any]]) -> List[SavedItem]:
    """What ``F.linear`` keeps of its input for ``g_W``: a view of its
    storage where its tokens merge into rows (once per storage), else a
    copy of its elements (also where only one image's do: the trace's
    batch-1 slice of a longer sequence, Segmenter's class embeddings
    ``x[:, -K:]``, merges at batch 1 but not at batch 2)."""
    eb = x.element_size()
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return [SavedItem(path, _category(path), x.numel(), eb)]
    if not _images_merge(x):
        return [SavedItem(path, _category(path), x.numel(), eb)]
    storage = x.untyped_storage()
    return _once(path, _category(path), storage.data_ptr(), storage.nbytes(),
                 eb, shared, storage)


def _images_merge(x: torch.Tensor) -> bool:
    """Whether the images of ``x`` (its first axis) would merge into rows
    with the rest at any batch (the rest merging, as at batch 1): the first
    axis's stride continues the second's (a batch-1 trace's tensor may be
    contiguous as a slice that is not at batch 2)."""
    if x.dim() < 3 or x.shape[0] != 1 or x.shape[1] == 1:
        return True
    return x.stride(0) == x.shape[1] * x.stride(1)


def _filter_ran(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the call ran the filtered Function (see
    :meth:`GFLinear.forward`)."""
    return (module._filter_active(x) and x.numel() > 0
            and module.current_grid() is not None and not x.is_complex()
            and not module.weight.is_complex())


def _linear_items(path: str, module: nn.Module, x: torch.Tensor,
                  shared: Dict[int, Tuple[str, Any]]) -> List[SavedItem]:
    weight, bias = module.weight, module.bias
    trained = weight.requires_grad or (bias is not None
                                       and bias.requires_grad)
    if LINEAR.is_filtered(module) and _filter_ran(module, x):
        if not weight.requires_grad:
            return []
        elements = patch_sum_elements(module.current_grid(), module.radius,
                                      x.numel(), x.shape[-1])
        return [SavedItem(path, _category(path), elements,
                          x.element_size())]
    if not trained and is_lean(module) and \
            lean_kind(module) == 'frozen_linear':
        return []  # keeps nothing (FrozenLinearFunction)
    items = []
    if weight.requires_grad:
        items += _input_rows(path, x, shared)
    if x.requires_grad:
        items += _weight_view(path, weight, shared)
    return items


def _projection_items(path: str, module: nn.Module,
                      shared: Dict[int, Tuple[str, Any]]
                      ) -> List[SavedItem]:
    """What the four projections of the last call kept."""
    call = module._gf_lean_call or module._gf_probabilities_call
    e, eb = call.dim, call.elem_bytes
    items = []
    if not module.enabled:
        needs_grad = False
        for ptr, nbytes, view, grad in module._exact_inputs:
            needs_grad = needs_grad or grad
            if view:
                items += _once(path, 'linear', ptr, nbytes, eb, shared)
            else:
                items.append(SavedItem(path, 'linear', nbytes // eb, eb))
        # the attention output's rows (unless SDPA's output, kept already,
        # holds them), and views of the weights (of the in-projection's
        # where an input needs a gradient)
        if module._out_rows_copied:
            items.append(SavedItem(path, 'linear',
                                   call.batch * call.q_len * e, eb))
        weights = [module.out_proj.weight]
        if needs_grad:
            weights.insert(0, module.in_proj_weight)
        for weight in weights:
            items += _weight_view(path, weight, shared)
        return items
    q_grid, k_grid = module.query_source.grid, module.key_source.grid
    elements = 2 * patch_sum_elements(q_grid, module.radius,
                                      call.batch * call.q_len * e, e)
    keys = {'qkv': 0, 'kv': 1, 'separate': 2}[module._packing]
    elements += keys * patch_sum_elements(k_grid, module.radius,
                                          call.batch * call.kv_len * e, e)
    return [SavedItem(path, 'linear', elements, eb)] + \
        filtered_weight_views(path, module, shared)


def filtered_weight_views(path: str, module: nn.Module,
                          shared: Dict[int, Tuple[str, Any]]
                          ) -> List[SavedItem]:
    """The view of ``in_proj_weight`` its filtered projections keep when
    the in-projection is split (keys apart from the queries: its parts,
    views, are saved; the whole Parameter is not counted): the same bytes
    at any batch."""
    if not module.enabled or module._packing in (None, 'qkv'):
        return []
    return _weight_view(path, module.in_proj_weight, shared)


def candidate_extra_items(path: str, module: nn.Module,
                          shared: Dict[int, Tuple[str, Any]]
                          ) -> List[SavedItem]:
    """What a budget candidate keeps beyond its layer kind's cost (the
    patch sums of its projections' inputs), the same filtered or exact: for
    a ``GFMultiheadAttention`` its attention's (SDPA's) tensors and the
    view of ``in_proj_weight`` its filtered projections keep when the keys
    are projected apart; nothing for other layers.

    Raises:
        LookupError: the attention ran a path the rules do not model.
    """
    if not ATTENTION.is_filtered(module):
        return []
    views = [] if module._packing in (None, 'qkv') else _weight_view(
        path, module.in_proj_weight, shared)
    if module._gf_lean_call is not None:
        return attention_items(path, module) + views
    if module._gf_probabilities_call is not None:
        return _probability_items(path, module) + views
    raise LookupError(path)


def _probability_items(path: str, module: nn.Module
                       ) -> List[SavedItem]:
    """The ``bmm`` path: ``q * scale``, the projection holding k and v
    (the packed ``3 L E`` one for self-attention, ``2 S E`` for a shared
    key/value, two ``S E`` ones otherwise) and the probabilities."""
    call = module._gf_probabilities_call
    if call.dropout:
        raise LookupError(path)
    b, e = call.batch, call.dim
    kv = 3 * call.q_len * e if module._packing == 'qkv' else \
        2 * call.kv_len * e
    return [SavedItem(path, 'attention', b * (call.q_len * e + kv),
                      call.elem_bytes),
            SavedItem(path, 'attention',
                      b * call.num_heads * call.q_len * call.kv_len,
                      call.elem_bytes)]


def _attention_call_items(path: str, module: nn.Module,
                          shared: Dict[int, Tuple[str, Any]]
                          ) -> List[SavedItem]:
    if module._gf_lean_call is not None:
        core = attention_items(path, module)
    elif module._gf_probabilities_call is not None:
        core = _probability_items(path, module)
    else:  # torch's own forward ran
        raise LookupError(path)
    return _projection_items(path, module, shared) + core


def token_items(path: str, module: nn.Module, x: torch.Tensor,
                out: torch.Tensor,
                shared: Dict[int, Tuple[str, Any]]
                ) -> Optional[List[SavedItem]]:
    """The kept rule of the ``linear`` and ``attention`` kinds (their
    :attr:`~mmseg_gf.models.layer_kinds.LayerKind.kept_rule`): the items of
    one recorded call of a Linear or a ``GFMultiheadAttention``, or None
    for any other module (a lean frozen attention: the other rules
    decide).

    Raises:
        LookupError: a call this module does not model (measured).
    """
    if ATTENTION.is_filtered(module):
        return _attention_call_items(path, module, shared)
    if LINEAR.is_filterable(module):
        return _linear_items(path, module, x, shared)
    return None
