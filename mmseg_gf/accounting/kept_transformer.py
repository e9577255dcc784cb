"""What the lean layers inside transformer blocks keep for backward.

The :mod:`.kept` rules for the kinds of
:mod:`mmseg_gf.models.lean_transformer` (and GELU), per image, from the
traced call's shapes; the table is in docs/cost.md, "Kept for backward,
per module kind"."""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..models.lean import is_lean, lean_kind
from ..models.lean_transformer import is_rule_owner
from ..models.patch_mean_gelu import patch_mean_partition
from ..ops.linear.patch_mean_activation import patch_mean_kept_elements
from ..patching import plain_class
from .kept import SavedItem, count_once, register_call_rule

__all__ = ['transformer_items', 'attention_items']


def attention_items(path: str, module: nn.Module,
                    shared: Optional[Dict[int, Tuple[str, Any]]] = None
                    ) -> List[SavedItem]:
    """What the last call of a lean attention kept (its ``_gf_lean_call``).

    Args:
        shared: the storages counted so far: SDPA's output is left out when
            an exact out-projection already counted it as its input.

    Raises:
        LookupError: its last call ran the plain forward (measured)."""
    call = getattr(module, '_gf_lean_call', None)
    if call is None:
        raise LookupError(path)
    images = call.images or 1
    outputs = 0 if (shared is not None and call.output_storage
                    and call.output_storage in shared) else 1
    tokens = call.batch * (call.q_len * (1 + outputs) + 2 * call.kv_len)
    items = [SavedItem(path, 'attention', tokens * call.dim // images,
                       call.elem_bytes),
             SavedItem(path, 'attention',
                       call.batch * call.num_heads * call.q_len // images,
                       call.stat_bytes)]
    if call.mask_elements:
        items.append(SavedItem(path, 'attention', call.mask_elements,
                               call.mask_bytes, 'const'))
    return items


def _input_item(path: str, category: str, x: torch.Tensor,
                shared: Dict[int, Tuple[str, Any]]) -> Optional[SavedItem]:
    """``x`` itself, once per tensor (another rule may keep it too)."""
    storage = x.untyped_storage()
    if not count_once(shared, path, storage.data_ptr(), storage):
        return None
    return SavedItem(path, category, x[0].numel(), x.element_size(),
                     storage=storage.data_ptr())


def transformer_items(path: str, module: nn.Module, x: torch.Tensor,
                      out: torch.Tensor,
                      shared: Dict[int, Tuple[str, Any]]
                      ) -> Optional[List[SavedItem]]:
    """The items of one recorded call of a transformer kind, or None for
    other modules.

    Raises:
        LookupError: a transformer kind that ran its plain path."""
    if is_rule_owner(module):
        return attention_items(path, module, shared)
    trained = any(p.requires_grad for p in module.parameters())
    kind = lean_kind(module) if is_lean(module) else None
    if kind == 'layer_norm' and not trained:
        tokens = x[0].numel() // _normalized(module)
        rstd_bytes = 8 if x.dtype == torch.float64 else 4
        items = [SavedItem(path, 'norm', tokens, rstd_bytes)]
        kept = _input_item(path, 'norm', x, shared)
        return items + ([kept] if kept is not None else [])
    if kind == 'drop_path':
        if not module.training or module.drop_prob == 0:
            return []
        return [SavedItem(path, 'dropout', 1, rule='bits')]
    if isinstance(module, nn.GELU) and getattr(module, '_gf_patch_mean_call',
                                               None) is not None:
        partition = patch_mean_partition(module)
        # batch-first shapes only (the engine installs no other)
        elements = patch_mean_kept_elements(module._gf_patch_mean_call,
                                            partition)
        return [SavedItem(path, 'activation', elements // x.shape[0],
                          x.element_size())]
    if plain_class(module) is nn.GELU:
        kept = _input_item(path, 'activation', x, shared)
        return [kept] if kept is not None else []
    return None


def _normalized(norm: nn.Module) -> int:
    size = 1
    for s in norm.normalized_shape:
        size *= int(s)
    return size


register_call_rule(transformer_items)
