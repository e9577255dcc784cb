"""Discovery: the layers on tokens a segmentor's inference path calls, each
with the grid of its call.

:func:`discover_token_grids` binds the model's grid rules, runs its
inference path once (:func:`run_inference_path`) and records every Linear
and attention called, in execution order, as a :class:`TracedLinear`; what
a call's grids are is its layer kind's
(:attr:`~mmseg_gf.models.layer_kinds.LayerKind.call_grids`).
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...ops.linear.token_grid import TokenGrid
from ..layer_kinds import layer_kind
from .binding import bind_token_grids
from .sites import LinearSite

__all__ = ['TracedLinear', 'run_inference_path', 'discover_token_grids']


@dataclass
class TracedLinear:
    """A Linear / attention called on the inference path, with the grid of
    its traced call.

    Attributes:
        path, kind, token_dim, rule, role: as in :class:`LinearSite`.
        input_shape: shape of its (query) input in the traced call.
        grid: its tokens' grid (the query's), or None.
        key_grid: an attention's key / value grid.
        no_grid: why ``grid`` is None.
    """

    path: str
    kind: str
    input_shape: Tuple[int, ...]
    grid: Optional[TokenGrid]
    key_grid: Optional[TokenGrid] = None
    token_dim: int = 1
    rule: Optional[str] = None
    no_grid: Optional[str] = None
    role: Optional[str] = None
    calls: int = field(default=1)


def _mismatch(calls) -> Optional[str]:
    """Why the traced call does not fit its grids, or None."""
    try:
        for grid, shape, axis in calls:
            grid.token_axis(shape, axis)
    except ValueError as err:
        return f'the traced call does not fit its grid: {err}'
    return None


def _record_call(site: LinearSite, module: nn.Module, args: tuple,
                 kwargs: dict) -> TracedLinear:
    calls = layer_kind(site.kind).call_grids(module, site, args, kwargs)
    shape = calls[0][1]
    if site.no_grid is not None:
        return TracedLinear(site.path, site.kind, shape, None, None,
                            site.token_dim, site.rule, site.no_grid,
                            site.role)
    if any(grid is None for grid, _, _ in calls):
        return TracedLinear(
            site.path, site.kind, shape, None, None, site.token_dim,
            site.rule, f'its {site.rule} rule set no grid for this call '
            '(called outside its block?)', site.role)
    mismatch = _mismatch(calls)
    key_grid = calls[1][0] if len(calls) > 1 else None
    return TracedLinear(site.path, site.kind, shape,
                        None if mismatch else calls[0][0],
                        None if mismatch else key_grid, site.token_dim,
                        site.rule, mismatch, site.role)


def run_inference_path(model: nn.Module, inputs: torch.Tensor):
    """``extract_feat`` and the decode head(s)' ``forward`` (a cascade
    feeds each head the previous output); auxiliary heads are not run."""
    feats = model.extract_feat(inputs)
    heads = model.decode_head
    heads = list(heads) if isinstance(heads, nn.ModuleList) else [heads]
    out = heads[0].forward(feats)
    for head in heads[1:]:
        out = head.forward(feats, out)
    return out


def discover_token_grids(model: nn.Module,
                         inputs: torch.Tensor) -> List[TracedLinear]:
    """Every Linear and ``nn.MultiheadAttention`` that ``model``'s
    inference path calls on ``inputs``, in execution order, with the token
    grid of its call (``grid=None`` and ``no_grid`` saying why for layers
    on no grid: Segmenter's class embeddings, layers no rule covers).

    Runs under ``torch.no_grad`` in eval mode (the mode is restored);
    leaves no hook behind.
    """
    bindings = bind_token_grids(model)
    traced: Dict[str, TracedLinear] = {}
    handles = []
    for path, site in bindings.sites.items():

        def record(module, args, kwargs, site=site):
            if site.path in traced:
                traced[site.path].calls += 1
            else:
                traced[site.path] = _record_call(site, module, args, kwargs)

        handles.append(
            model.get_submodule(site.path).register_forward_pre_hook(
                record, with_kwargs=True))
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            run_inference_path(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
        bindings.remove()
        for module, mode in modes.items():
            module.training = mode
    return list(traced.values())
