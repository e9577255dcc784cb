"""What Segmenter's mask transformer head keeps in its own code and loss.

Its forward ends in functional code (the normalised patch and class
embeddings' product), which no module rule sees; the head is a registered
call owner counted here from the traced call's shapes (docs/cost.md,
"Kept for backward, per module kind", has the table)."""
from typing import Any, Dict, List, Optional, Tuple

import torch
from mmseg.models.decode_heads.segmenter_mask_head import \
    SegmenterMaskTransformerHead
from torch import nn

from ..models.lean import is_lean
from ..models.lean_head import loss_gradient_copies
from .kept import SavedItem, register_call_owner, register_call_rule

__all__ = ['is_mask_head', 'mask_head_items']


def is_mask_head(module: nn.Module) -> bool:
    """Segmenter's mask transformer head (its own code is counted here)."""
    return isinstance(module, SegmenterMaskTransformerHead)


def _trains(*modules: Optional[nn.Module]) -> bool:
    return any(p.requires_grad for m in modules if m is not None
               for p in m.parameters())


def _needs_gradient(head: nn.Module, x: torch.Tensor) -> Tuple[bool, bool]:
    """Whether ``patches`` and the class embeddings' projection need a
    gradient in the call."""
    shared = x.requires_grad or _trains(head.dec_proj, head.decoder_norm)
    layers = len(head.layers) > 0
    cls_emb = head.cls_emb.requires_grad
    if layers:
        shared = shared or cls_emb or _trains(head.layers)
    patches = shared or _trains(head.patch_proj)
    classes = (shared if layers else
               cls_emb or _trains(head.decoder_norm)) or \
        _trains(head.classes_proj)
    return patches, classes


def mask_head_items(path: str, module: nn.Module, x: torch.Tensor,
                    out: torch.Tensor, shared: Dict[int, Tuple[str, Any]]
                    ) -> Optional[List[SavedItem]]:
    """The items of a recorded call of Segmenter's mask head (its own
    code and its lean loss), or None for any other module."""
    if not is_mask_head(module):
        return None
    if out.dim() != 4:
        raise LookupError(path)
    classes, height, width = (int(s) for s in out.shape[1:])
    tokens = height * width
    dim = module.patch_proj.out_features
    eb = out.element_size()
    patches_grad, classes_grad = _needs_gradient(module, x)
    elements = 0
    if patches_grad:  # normalize(patches); the product keeps the classes
        elements += tokens * (dim + 2) + classes * dim
    if classes_grad:  # normalize(classes); the product keeps the patches
        elements += classes * (dim + 2) + tokens * dim
    items = [SavedItem(path, 'classifier', elements, eb)] if elements else []
    if is_lean(module) and out.requires_grad:
        copies = loss_gradient_copies(module)
        items.append(SavedItem(path, 'logits',
                               (copies or 1) * out[0].numel(), eb,
                               estimate=copies is None))
    return items


register_call_owner(is_mask_head)
register_call_rule(mask_head_items)
