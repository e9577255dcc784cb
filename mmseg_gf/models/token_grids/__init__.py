"""Token grids of the Linear layers in mmseg's transformer models.

A gradient-filtered Linear needs the grid its tokens lie on
(docs/gradient_filter.md#linear-layers-on-token-grids), and the token count
alone does not give it. mmseg's transformer blocks do: they are called with
the ``hw_shape`` of their tokens, a ViT's patch embedding returns it, a
Swin window has a fixed size. This package holds one *grid rule* per mmseg
block that knows its grid, and:

* :mod:`.registry`: :func:`register_grid_rule`, the decorator a family's
  rules are registered with (:mod:`.rules`: one file per family);
* :mod:`.binding`: :func:`bind_token_grids` registers hooks on those
  blocks that keep a :class:`TokenGridSource` current for every call, and
  describes each layer on tokens (Linear, ``nn.MultiheadAttention``) as a
  :class:`LinearSite` (:mod:`.sites`: which source gives its grid, on which
  token axis, or why it has none); :func:`install_token_grids` keeps them
  on a segmentor for training, :mod:`.recompute` covers blocks built with
  ``with_cp=True``;
* :mod:`.discovery`: :func:`discover_token_grids` runs a segmentor's
  inference path once on a dummy input and lists every Linear and attention
  called, in execution order, with the grid of its traced call.

The filtered module of a site is its layer kind's
(:attr:`~mmseg_gf.models.layer_kinds.LayerKind.from_plain`, reading the site of
the module: ``GFLinear`` / ``GFMultiheadAttention``, sharing Parameters).
A Linear that no rule covers is reported with ``grid=None`` and the
reason; a ``with_cp`` module of a class no rule declares checkpointed,
holding a bound Linear, has its Linears described with ``no_grid``
(refused by the selection, with the reason).
"""
from ..gf_linear import TokenGridSource
from .binding import (BINDINGS_ATTR, TokenGridBindings, bind_token_grids,
                      install_token_grids, site_of, uninstall_token_grids)
from .discovery import TracedLinear, discover_token_grids, run_inference_path
from .registry import (GridRule, grid_rules, register_grid_rule,
                       unregister_grid_rule)
from .sites import CLASS_SCORES, LinearSite, token_kind_of
from . import rules  # noqa: F401,E402  (registers the built-in rules)

__all__ = [
    'BINDINGS_ATTR', 'CLASS_SCORES', 'GridRule', 'LinearSite',
    'TokenGridBindings', 'TokenGridSource', 'TracedLinear',
    'bind_token_grids', 'discover_token_grids', 'grid_rules',
    'install_token_grids', 'register_grid_rule', 'run_inference_path',
    'site_of', 'token_kind_of', 'uninstall_token_grids',
    'unregister_grid_rule'
]
