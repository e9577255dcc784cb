"""What the bindings say of each layer on tokens: its site.

A layer on tokens is a module of a layer kind that reads a token grid
(:attr:`~mmseg_gf.models.layer_kinds.LayerKind.call_grids`: ``nn.Linear``,
``nn.MultiheadAttention``); the kinds, not this package, name the module
types. Its :class:`LinearSite` says which
:class:`~mmseg_gf.models.gf_linear.TokenGridSource` holds its grid, or why
it has none.
"""
from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..gf_linear import TokenGridSource
from ..layer_kinds import LayerKind, traced_kind_of

__all__ = ['CLASS_SCORES', 'LinearSite', 'token_kind_of']

#: Role of Segmenter's two projections whose product is the class scores.
CLASS_SCORES = 'class_scores'


@dataclass
class LinearSite:
    """A Linear or attention of the model and where its grid comes from.

    Attributes:
        path: module path.
        kind: the name of its layer kind (``'linear'``, ``'attention'``:
            an ``nn.MultiheadAttention``'s packed in-projection and its
            out-projection).
        source: the grid of its tokens (the query's, for an attention).
        key_source: an attention's key / value grid.
        token_dim: the token axis of a Linear's input.
        rule: the block class whose rule bound it.
        no_grid: why the layer has no grid (then ``source`` is None).
        role: :data:`CLASS_SCORES` for Segmenter's class-score projections.
    """

    path: str
    kind: str
    source: Optional[TokenGridSource] = None
    key_source: Optional[TokenGridSource] = None
    token_dim: int = 1
    rule: Optional[str] = None
    no_grid: Optional[str] = None
    role: Optional[str] = None


def token_kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind of ``module`` if it is a layer on tokens, else None."""
    kind = traced_kind_of(module)
    return kind if kind is not None and kind.call_grids is not None else None


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or a module below it."""
    return not prefix or path == prefix or path.startswith(prefix + '.')


def join(prefix: str, name: str) -> str:
    """The path of child ``name`` of the module at ``prefix``."""
    return f'{prefix}.{name}' if prefix else name


def inside_token_layer(root: nn.Module, prefix: str, path: str) -> bool:
    """True for a module under a layer on tokens (an attention's
    ``out_proj``: called by the attention's forward, not as a module).

    ``root`` is the module at ``prefix``; ``path`` a path below it.
    """
    parts = path[len(prefix):].lstrip('.').split('.') if path != prefix \
        else []
    module = root
    for part in parts[:-1]:
        module = getattr(module, part)
        if token_kind_of(module) is not None:
            return True
    return False
