"""The layer kinds on tokens: ``nn.Linear`` and ``nn.MultiheadAttention``
on token grids (docs/gradient_filter.md#linear-layers-on-token-grids).

Registered after ``conv2d`` (:mod:`.layer_kinds`). Their grid comes from the
model, never from the token count: the kinds' ``prepare`` binds the grid
rules of mmseg's transformer blocks (:func:`.token_grids.bind_token_grids`)
on the segmentor, so that during a traced call ``geometry`` reads the grid
of the call and ``from_plain`` hands the filtered module the source that
keeps it current (``GFLinear`` / ``GFMultiheadAttention``, sharing Parameters).

Cost: a Linear on an ``H x W`` grid is a 1x1-kernel conv on that grid
(``ops/conv/cost.py``): the filter keeps the patch sums of its input and
computes ``g_W`` / ``g_x`` on ``ceil(H/r) ceil(W/r)`` patches. Tokens on no
grid (a ViT's cls token, Segmenter's class embeddings) keep their exact
backward and count as a 1x1 conv at ``r = 1``; a Swin window grid counts
once per window of the call. An attention counts its packed in-projection
(queries on the query grid, keys and values on the key grid) and its
out-projection; what its softmax keeps is no layer's cost (the accounting
measures it).
"""
from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence, Tuple

from torch import Tensor, nn

from ..ops.conv.cost import ConvBackwardCost, conv_backward_cost
from ..ops.linear.token_grid import TokenGrid
from .gradient_quality import GradientQuality
from .gf_attention import GFMultiheadAttention
from .gf_linear import GFLinear, plain_linear_classes
from .layer_kinds import LayerKind, register_layer_kind
from .token_grids import (BINDINGS_ATTR, LinearSite, bind_token_grids,
                          install_token_grids, site_of)

__all__ = ['TokenGeometry', 'LINEAR', 'ATTENTION', 'prepare_token_grids']


def _add(a: ConvBackwardCost, b: ConvBackwardCost) -> ConvBackwardCost:
    return ConvBackwardCost(**{
        f.name: getattr(a, f.name) + getattr(b, f.name)
        for f in fields(ConvBackwardCost)
    })


@dataclass(frozen=True)
class TokenGeometry:
    """A Linear's (or an attention's) tokens at one call.

    Attributes:
        in_shape, out_shape: ``(C, H, W)`` of the grid (a window's for
            Swin); ``(C, N, 1)`` for tokens on no grid.
        grid: the tokens' grid, or None (exact backward).
        instances: grids in the call (windows of Swin, else the batch of
            the call: 1 for the selection's trace).
        projections: ``(cin, cout, grid)`` of each projection computed on
            a grid: one for a Linear; an attention's in-projection (q, and
            k/v on the key grid when it differs) and out-projection.
        no_grid: why ``grid`` is None.
        role: ``'class_scores'`` for Segmenter's class-score layers.
        label: ``'linear'`` or ``'attn'``.
    """

    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    grid: Optional[TokenGrid]
    instances: int
    projections: Tuple[Tuple[int, int, Optional[TokenGrid]], ...]
    no_grid: Optional[str] = None
    role: Optional[str] = None
    label: str = 'linear'
    tokens: int = 0

    @property
    def map_area(self) -> int:
        """Positions of the map the tokens lie on
        (:func:`~mmseg_gf.ops.conv.cost.map_output_stride`): a window
        layout's windows together (the selection traces one image, so its
        call's windows tile one map), else the grid, or the token count
        on no grid."""
        if self.grid is None:
            return self.tokens
        area = self.out_shape[1] * self.out_shape[2]
        if self.grid.layout == 'windows':
            area *= self.instances
        return area

    def describe(self) -> str:
        """``linear 7x7 win``, ``grid 16x16 +1 cls``, ``attn 16x16 kv
        4x4``, ``no grid (N tokens)``: the layer tables' cell."""
        if self.grid is None:
            return f'{self.label} no grid ({self.tokens} tokens)'
        g = self.grid
        text = f'{self.label} {g.height}x{g.width}'
        if g.layout == 'windows':
            text += ' win'
        extra = g.extra_tokens + g.trailing_tokens
        if extra:
            text += f' +{extra} cls'
        keys = [p[2] for p in self.projections if p[2] is not g]
        if keys and keys[0] is not None:
            text += f' kv {keys[0].height}x{keys[0].width}'
        return text

    def cost(self, radius: int, batch: int = 1,
             need_input_grad: bool = True, need_weight_grad: bool = True,
             elem_bytes: int = 4,
             collapse_dilated: bool = False) -> ConvBackwardCost:
        """A 1x1 conv's cost on each projection's grid (tokens on no grid
        at ``r = 1``); ``collapse_dilated`` does not apply."""
        total = None
        for cin, cout, grid in self.projections:
            for hw, r in _token_blocks(grid, self.tokens, radius):
                part = conv_backward_cost(
                    cin, cout, 1, 1, 1, 1, 1, hw, hw,
                    batch * self.instances, r, need_input_grad,
                    need_weight_grad, elem_bytes)
                total = part if total is None else _add(total, part)
        return total


def _token_blocks(grid: Optional[TokenGrid], tokens: int, radius: int):
    """``((H, W), r)`` blocks of a call's tokens: the grid at ``radius``
    and the tokens on no grid at ``r = 1``."""
    if grid is None:
        return [((max(tokens, 1), 1), 1)]
    blocks = [((grid.height, grid.width), radius)]
    extra = grid.extra_tokens + grid.trailing_tokens
    if extra:
        blocks.append(((extra, 1), 1))
    return blocks


def _instances(x: Tensor, grid: Optional[TokenGrid], token_dim: int) -> int:
    """Grids in one call: the product of the axes before the token axis."""
    if grid is None:
        return 1
    axis = token_dim % x.dim() if x.dim() else 0
    n = 1
    for size in x.shape[:axis]:
        n *= int(size)
    return max(n, 1)


def _linear_source(module: nn.Module) -> Tuple[Optional[TokenGrid], int,
                                               Optional[LinearSite]]:
    site = site_of(module)
    if isinstance(module, GFLinear):
        source = module.grid_source
        return (None if source is None else source.grid), module.token_dim, \
            site
    if site is None or site.source is None:
        return None, 1, site
    return site.source.grid, site.token_dim, site


def _linear_geometry(module: nn.Module, inputs: Sequence,
                     output: Tensor) -> TokenGeometry:
    x = inputs[0]
    grid, token_dim, site = _linear_source(module)
    if grid is not None:
        try:
            grid.token_axis(tuple(x.shape), token_dim)
        except ValueError:
            grid = None
    cin, cout = module.in_features, module.out_features
    tokens = int(x.shape[token_dim]) if x.dim() > 1 else 1
    no_grid = None
    if grid is None:
        no_grid = (site.no_grid if site is not None and site.no_grid else
                   'no token-grid rule gave a grid for its call')
        return TokenGeometry((cin, tokens, 1), (cout, tokens, 1), None, 1,
                             ((cin, cout, None), ), no_grid,
                             None if site is None else site.role,
                             tokens=tokens)
    h, w = grid.height, grid.width
    return TokenGeometry((cin, h, w), (cout, h, w), grid,
                         _instances(x, grid, token_dim),
                         ((cin, cout, grid), ), None,
                         None if site is None else site.role, tokens=tokens)


def _attention_geometry(module: nn.Module, inputs: Sequence,
                        output) -> TokenGeometry:
    query = inputs[0] if inputs else None
    site = site_of(module)
    if isinstance(module, GFMultiheadAttention):
        q_src, k_src = module.query_source, module.key_source
    elif site is not None:
        q_src, k_src = site.source, site.key_source
    else:
        q_src = k_src = None
    qg = None if q_src is None else q_src.grid
    kg = None if k_src is None else k_src.grid
    e = module.embed_dim
    batch_first = getattr(module, 'batch_first', False) and \
        query is not None and query.dim() == 3
    axis = 1 if batch_first else 0
    tokens = int(query.shape[axis]) if query is not None else 0
    if qg is None or kg is None:
        why = (site.no_grid if site is not None and site.no_grid else
               'no token-grid rule gave a grid for its call')
        return TokenGeometry((e, tokens, 1), (e, tokens, 1), None, 1,
                             ((e, 3 * e, None), (e, e, None)), why,
                             label='attn', tokens=tokens)
    if kg == qg:
        projections = ((e, 3 * e, qg), (e, e, qg))
    else:
        projections = ((e, e, qg), (e, 2 * e, kg), (e, e, qg))
    return TokenGeometry((e, qg.height, qg.width), (e, qg.height, qg.width),
                         qg, 1, projections, label='attn', tokens=tokens)


def _refuse_no_grid(module: nn.Module, site: Optional[LinearSite]) -> None:
    why = ('no token-grid rule covers it (its model\'s grids are not '
           'bound)' if site is None else site.no_grid)
    raise ValueError(
        f'a {type(module).__name__} whose tokens lie on no grid cannot be '
        f'gradient-filtered: {why}')


def _linear_from_plain(module: nn.Module, radius: int,
                       enabled: bool) -> GFLinear:
    site = site_of(module)
    if site is None or site.source is None:
        _refuse_no_grid(module, site)
    return GFLinear.from_linear(module, radius, site.source, site.token_dim,
                                enabled)


def _attention_from_plain(module: nn.Module, radius: int,
                          enabled: bool) -> GFMultiheadAttention:
    site = site_of(module)
    if site is None or site.source is None:
        _refuse_no_grid(module, site)
    return GFMultiheadAttention.from_attention(module, radius, site.source,
                                               site.key_source, enabled)


def _no_quality(module, x, grad_out, radius) -> GradientQuality:
    raise NotImplementedError(
        f'gradient quality of a {type(module).__name__}: only convs have a '
        'local quality measure (tools/gradient_quality.py)')


def _grid(source) -> Optional[TokenGrid]:
    return None if source is None else source.grid


def _linear_call_grids(module: nn.Module, site: LinearSite, args: tuple,
                       kwargs: dict) -> tuple:
    """A Linear's one input, on its site's grid and token axis."""
    return ((_grid(site.source), tuple(args[0].shape), site.token_dim), )


def _attention_call_grids(module: nn.Module, site: LinearSite, args: tuple,
                          kwargs: dict) -> tuple:
    """The query on the site's grid, the key on its key grid; token axis 1
    for a batch-first 3-D call, else 0."""
    if not args:  # called with keywords
        args = (kwargs['query'], kwargs['key'], kwargs['value'])
    query, key = args[0], args[1]
    axis = 1 if module.batch_first and query.dim() == 3 else 0
    return ((_grid(site.source), tuple(query.shape), axis),
            (_grid(site.key_source), tuple(key.shape), axis))


#: What a call of a Linear / attention keeps (:mod:`mmseg_gf.accounting`).
_TOKEN_KEPT_RULE = 'mmseg_gf.accounting.kept_tokens:token_items'


def prepare_token_grids(model: nn.Module) -> Optional[Callable[[], None]]:
    """Bind ``model``'s token grids for a trace; returns the undo, or None
    when the model has them installed already (by the surgery)."""
    if model.__dict__.get(BINDINGS_ATTR) is not None:
        return None
    return bind_token_grids(model).remove


def install_for_training(model: nn.Module) -> None:
    """Install ``model``'s token-grid bindings for good (surgery)."""
    install_token_grids(model)


#: ``nn.Linear`` on a token grid (MiT, Swin, Twins, ViT blocks, Segmenter).
LINEAR = register_layer_kind(LayerKind(
    name='linear',
    noun='linear layer',
    traced_type=nn.Linear,
    plain_types=plain_linear_classes(),
    filtered_type=GFLinear,
    from_plain=_linear_from_plain,
    geometry=_linear_geometry,
    quality=_no_quality,
    allowed='nn.Linear on a token grid (GFLinear)',
    prepare=prepare_token_grids,
    install=install_for_training,
    kept_rule=_TOKEN_KEPT_RULE,
    frozen_lean='frozen_linear',
    patch_partitioned=True,
    call_grids=_linear_call_grids,
    category='linear'))

#: ``nn.MultiheadAttention``: packed in-projection and out-projection.
ATTENTION = register_layer_kind(LayerKind(
    name='attention',
    noun='attention',
    traced_type=nn.MultiheadAttention,
    plain_types=(nn.MultiheadAttention, ),
    filtered_type=GFMultiheadAttention,
    from_plain=_attention_from_plain,
    geometry=_attention_geometry,
    quality=_no_quality,
    allowed='nn.MultiheadAttention on token grids (GFMultiheadAttention)',
    prepare=prepare_token_grids,
    install=install_for_training,
    kept_rule=_TOKEN_KEPT_RULE,
    frozen_lean='attention',
    call_grids=_attention_call_grids,
    category='attention'))
