"""What trained layers on tokens keep for backward.

The :mod:`.kept` rules of the token kinds and of plain Linears on the
gradient path, per image (docs/cost.md, "Kept for backward, per module
kind"). An attention with dropout on its probabilities, or running
torch's own forward (masks, ``kdim`` / ``vdim``), is measured instead."""
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
    """Elements a filtered projection keeps of ``numel`` input elements: the
    grid tokens' patch sums and the tokens on no grid."""
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
    """What ``F.linear`` keeps of its input for ``g_W``: a view where its
    tokens merge into rows at any batch (once per storage), else a copy."""
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
    """Whether the images of ``x`` would merge into rows at any batch, not
    only in the batch-1 trace."""
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
    """The view of ``in_proj_weight`` filtered projections keep when the keys
    are projected apart (the same bytes at any batch)."""
    if not module.enabled or module._packing in (None, 'qkv'):
        return []
    return _weight_view(path, module.in_proj_weight, shared)


def candidate_extra_items(path: str, module: nn.Module,
                          shared: Dict[int, Tuple[str, Any]]
                          ) -> List[SavedItem]:
    """What a budget candidate keeps beyond its layer kind's cost: for a
    ``GFMultiheadAttention`` its SDPA tensors and weight views; else nothing.

    Raises:
        LookupError: the attention ran a path the rules do not model."""
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
    """The ``bmm`` path: ``q * scale``, the projection holding k and v, and
    the probabilities."""
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
    """The kept rule of the ``linear`` and ``attention`` kinds: one recorded
    call's items, or None for any other module.

    Raises:
        LookupError: a call this module does not model (measured)."""
    if ATTENTION.is_filtered(module):
        return _attention_call_items(path, module, shared)
    if LINEAR.is_filterable(module):
        return _linear_items(path, module, x, shared)
    return None
