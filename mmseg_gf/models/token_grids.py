"""Token grids of the Linear layers in mmseg's transformer models.

A gradient-filtered Linear needs the grid its tokens lie on
(docs/gradient_filter.md#linear-layers-on-token-grids), and the token count
alone does not give it. mmseg's transformer blocks do: they are called with
the ``hw_shape`` of their tokens, a ViT's patch embedding returns it, a
Swin window has a fixed size. This module holds one *grid rule* per mmseg
block that knows its grid, and:

* :func:`bind_token_grids` registers hooks on those blocks that keep a
  :class:`TokenGridSource` current for every call, and describes each
  Linear / ``nn.MultiheadAttention`` of the model as a :class:`LinearSite`
  (which source gives its grid, on which token axis, or why it has none);
* :func:`discover_token_grids` runs a segmentor's inference path once on a
  dummy input and lists every Linear and attention called, in execution
  order, with the grid of its traced call;
* :func:`filtered_module` builds the filtered module of a site
  (``GFLinear`` / ``GFMultiheadAttention``, sharing Parameters).

The rules cover mmseg 1.2.2's MixVisionTransformer (Segformer), Swin,
Twins PCPVT / SVT, VisionTransformer (DeiT, also under Segmenter, SETR,
DPT) and ``SegmenterMaskTransformerHead``. A Linear that no rule covers is
reported with ``grid=None`` and the reason.

Hooks sit on blocks (layers, patch embeddings, heads), never on the Linears,
convs or attentions a surgery may replace, so they survive the swap. They
are objects holding their sources (rules hold none), so ``copy.deepcopy``
of a model gives a copy whose hooks set the copy's sources, those its
filtered layers read; nothing of them is in ``state_dict``. The surgery
installs them on the segmentor (:func:`install_token_grids`), so a DDP
wrapper, which runs the same module, runs them too. The
grids are set by the forward of the block and cleared after it.

A block built with ``with_cp=True`` (Swin's, MiT's and ViT's layers) runs
``torch.utils.checkpoint.checkpoint(_inner_forward, x)``: the backward
recomputes ``_inner_forward`` without the block's hooks, so its Linears
would find their grids cleared, or set by another call. The bindings give
such a block a forward of their own (:class:`_CheckpointWithGrids`) that
takes the checkpoint in its place, on a function that first sets the
grids of the call being recomputed: every filtered Linear in it gets its
true grid in the recompute. A ``with_cp`` module of another class holding
a bound Linear has its Linears described with ``no_grid`` (refused by the
selection, with the reason).
"""

import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import checkpoint
from mmseg.models.backbones.mit import \
    TransformerEncoderLayer as MiTEncoderLayer
from mmseg.models.backbones.swin import SwinBlock
from mmseg.models.backbones.twins import GSAEncoderLayer, LSAEncoderLayer
from mmseg.models.backbones.vit import \
    TransformerEncoderLayer as ViTEncoderLayer
from mmseg.models.backbones.vit import VisionTransformer
from mmseg.models.decode_heads.segmenter_mask_head import \
    SegmenterMaskTransformerHead
from mmseg.models.utils.embed import PatchMerging
from torch import nn

from ..ops.gradient_filter_linear import TokenGrid
from .gf_attention import GFMultiheadAttention
from .gf_linear import GFLinear, TokenGridSource

#: Role of Segmenter's two projections whose product is the class scores.
CLASS_SCORES = 'class_scores'


@dataclass
class LinearSite:
    """A Linear or attention of the model and where its grid comes from.

    Attributes:
        path: module path.
        kind: ``'linear'`` (``nn.Linear``) or ``'attention'``
            (``nn.MultiheadAttention``: its packed in-projection and its
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


class _SetGrids:
    """A hook setting grid sources from a rule. An object, not a closure,
    so that ``copy.deepcopy`` of a model copies its sources along with the
    filtered layers reading them (the copy's hooks set the copy's
    sources); ``rule`` holds no source."""

    def __init__(self, rule: Callable, sources: Sequence[TokenGridSource]
                 ) -> None:
        self.rule = rule
        self.sources = tuple(sources)

    def __call__(self, module, args, *rest) -> None:
        for source, grid in zip(self.sources, self.rule(module, args,
                                                        *rest)):
            source.set(grid)


class _ClearGrids:
    """A forward hook clearing grid sources after the block's call."""

    def __init__(self, sources: Sequence[TokenGridSource]) -> None:
        self.sources = tuple(sources)

    def __call__(self, module, args, kwargs, output) -> None:
        for source in self.sources:
            source.clear()


class _CheckpointWithGrids:
    """The forward of a block that mmseg checkpoints with ``with_cp=True``,
    installed as the block's instance attribute ``forward``.

    mmseg's block (e.g. ``SwinBlock.forward``) checkpoints its inner
    forward when ``self.with_cp and x.requires_grad``, with torch's default
    (reentrant) checkpoint. This forward takes the same checkpoint under the
    same condition, of a function that sets the grids the block's Linears
    read to those of this call (captured now), runs the block's own forward
    with ``with_cp`` off, and restores the grids it found: the recompute in
    the backward runs that function too, so it reads this call's grids,
    whichever call ran last. Otherwise it is the block's own forward. An
    object, as :class:`_SetGrids`, so that ``copy.deepcopy`` of a model
    gives the copy's block and sources.
    """

    def __init__(self, block: nn.Module,
                 sources: Sequence[TokenGridSource]) -> None:
        self.block = block
        self.sources = tuple(sources)

    def __call__(self, x, *args, **kwargs):
        block = self.block
        forward = type(block).forward
        if not (block.with_cp and x.requires_grad):
            return forward(block, x, *args, **kwargs)
        grids = tuple(source.grid for source in self.sources)

        def recomputable(x):
            found = tuple(source.grid for source in self.sources)
            for source, grid in zip(self.sources, grids):
                source.set(grid)
            block.with_cp = False
            try:
                return forward(block, x, *args, **kwargs)
            finally:
                block.with_cp = True
                for source, grid in zip(self.sources, found):
                    source.set(grid)

        return checkpoint(recomputable, x, use_reentrant=True)


class TokenGridBindings:
    """The hooks that keep a model's grid sources current, and its sites."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: Dict[str, LinearSite] = {}
        self._handles: List = []
        self._checkpointed: List[nn.Module] = []

    def remove(self) -> None:
        """Remove every hook (the sources then stay empty) and forget the
        modules' sites (:func:`site_of`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self._checkpointed:
            if isinstance(block.__dict__.get('forward'),
                          _CheckpointWithGrids):
                del block.__dict__['forward']
        self._checkpointed.clear()
        for module, (owner, _) in list(_SITE_OF.items()):
            if owner is self:
                del _SITE_OF[module]

    def publish(self) -> None:
        """Make each bound module's site known to :func:`site_of` (the
        layer kinds' geometry and wrap read it)."""
        for path, site in self.sites.items():
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                continue
            _SITE_OF[module] = (self, site)

    # -- used by the rules ---------------------------------------------------
    def set_around(self, block: nn.Module,
                   rule: Callable[[nn.Module, tuple, dict], tuple],
                   sources: Sequence[TokenGridSource]) -> None:
        """Before every call of ``block`` set ``sources`` to the grids
        ``rule(block, args, kwargs)`` gives; clear them after it."""
        self._handles.append(
            block.register_forward_pre_hook(_SetGrids(rule, sources),
                                            with_kwargs=True))
        self._handles.append(
            block.register_forward_hook(_ClearGrids(sources),
                                        with_kwargs=True, always_call=True))

    def set_after(self, module: nn.Module,
                  rule: Callable[[nn.Module, tuple, object], tuple],
                  sources: Sequence[TokenGridSource]) -> None:
        """After every call of ``module`` set ``sources`` to the grids
        ``rule(module, args, output)`` gives."""
        self._handles.append(
            module.register_forward_hook(_SetGrids(rule, sources)))

    def recompute_with_grids(self, block: nn.Module, prefix: str) -> None:
        """Give ``block`` (a :data:`CHECKPOINTED_BLOCKS` instance) the
        forward that checkpoints it with the grids of each call
        (:class:`_CheckpointWithGrids`), for the sources its Linears
        read."""
        sources = []
        for path, site in self.sites.items():
            if not _under(path, prefix):
                continue
            for source in (site.source, site.key_source):
                if source is not None and all(source is not s
                                              for s in sources):
                    sources.append(source)
        if sources:
            block.forward = _CheckpointWithGrids(block, sources)
            self._checkpointed.append(block)

    def bind(self, site: LinearSite) -> None:
        if site.path not in self.sites:  # the innermost rule wins
            self.sites[site.path] = site

    def bind_all(self, container: nn.Module, prefix: str,
                 source: TokenGridSource, rule: str) -> None:
        """Every Linear and attention under ``container`` reads ``source``
        (self-attention: keys on the same grid)."""
        for name, module in container.named_modules(prefix=prefix):
            kind = layer_kind(module)
            if kind is not None and not _inside_attention(container, prefix,
                                                          name):
                self.bind(LinearSite(name, kind, source, source, 1, rule))


def layer_kind(module: nn.Module) -> Optional[str]:
    """``'attention'``, ``'linear'`` or None (not a layer on tokens)."""
    if isinstance(module, nn.MultiheadAttention):
        return 'attention'
    if isinstance(module, nn.Linear):
        return 'linear'
    return None


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + '.')


def _inside_attention(root: nn.Module, prefix: str, path: str) -> bool:
    """True for a module under an ``nn.MultiheadAttention`` (its
    ``out_proj``: called by the attention's forward, not as a module)."""
    parts = path[len(prefix):].lstrip('.').split('.') if path != prefix \
        else []
    module = root
    for part in parts[:-1]:
        module = getattr(module, part)
        if isinstance(module, nn.MultiheadAttention):
            return True
    return False


def _hw(args: tuple, kwargs: dict, name: str, index: int) -> Tuple[int, int]:
    hw = kwargs[name] if name in kwargs else args[index]
    return int(hw[0]), int(hw[1])


def _conv_out(size: int, conv: nn.Module, axis: int) -> int:
    k, s = conv.kernel_size[axis], conv.stride[axis]
    p, d = conv.padding[axis], conv.dilation[axis]
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _key_grid(attention: nn.Module, hw: Tuple[int, int]) -> TokenGrid:
    """The key / value grid of Segformer's efficient (Twins' global
    sub-sampled) attention: the output of its ``sr`` conv when
    ``sr_ratio > 1``, else the query's grid."""
    if getattr(attention, 'sr_ratio', 1) > 1:
        sr = attention.sr
        return TokenGrid(_conv_out(hw[0], sr, 0), _conv_out(hw[1], sr, 1))
    return TokenGrid(*hw)


# -- the rules ---------------------------------------------------------------
def _reduced_grids(module, args, kwargs) -> tuple:
    hw = _hw(args, kwargs, 'hw_shape', 1)
    return TokenGrid(*hw), _key_grid(module.attn, hw)


def _hw_grid(module, args, kwargs) -> tuple:
    return (TokenGrid(*_hw(args, kwargs, 'hw_shape', 1)), )


def _spatial_reduction_layer(bindings: TokenGridBindings, path: str,
                             layer: nn.Module) -> None:
    """MiT's ``TransformerEncoderLayer`` / Twins' ``GSAEncoderLayer``:
    ``forward(x, hw_shape)``; the attention's keys on the ``sr`` grid."""
    rule = type(layer).__name__
    tokens = TokenGridSource(name=path)
    keys = TokenGridSource(name=f'{path}.attn.sr')

    bindings.set_around(layer, _reduced_grids, (tokens, keys))
    bindings.bind(
        LinearSite(f'{path}.attn.attn', 'attention', tokens, keys, 1, rule))
    bindings.bind_all(layer, path, tokens, rule)


def _hw_shape_layer(bindings: TokenGridBindings, path: str,
                    layer: nn.Module) -> None:
    """Swin's ``SwinBlock`` / Twins' ``LSAEncoderLayer``:
    ``forward(x, hw_shape)``; windowed attention on fixed window grids."""
    rule = type(layer).__name__
    tokens = TokenGridSource(name=path)
    bindings.set_around(layer, _hw_grid, (tokens, ))
    if isinstance(layer, SwinBlock):
        # WindowMSA: (B * windows, ws * ws, C), the window's grid
        w_msa = layer.attn.w_msa
        window = TokenGridSource(TokenGrid.windows(tuple(w_msa.window_size)),
                                 name=f'{path}.attn.w_msa.window_size')
        for name in ('qkv', 'proj'):
            bindings.bind(
                LinearSite(f'{path}.attn.w_msa.{name}', 'linear', window,
                           None, 1, rule))
    else:
        # LocallyGroupedSelfAttention: qkv on (B, h, w, ws, ws, C) windows
        ws = layer.attn.window_size
        window = TokenGridSource(TokenGrid(ws, ws, layout='hwc'),
                                 name=f'{path}.attn.window_size')
        bindings.bind(
            LinearSite(f'{path}.attn.qkv', 'linear', window, None, 3, rule))
    bindings.bind_all(layer, path, tokens, rule)


def _merged_grid(module, args, kwargs) -> tuple:
    h, w = _hw(args, kwargs, 'input_size', 1)
    if module.adap_padding:
        pad_h, pad_w = module.adap_padding.get_pad_shape((h, w))
        h, w = h + pad_h, w + pad_w
    sampler = module.sampler
    sizes = []
    for axis, size in enumerate((h, w)):
        k, s = _pair(sampler.kernel_size)[axis], _pair(sampler.stride)[axis]
        p, d = _pair(sampler.padding)[axis], _pair(sampler.dilation)[axis]
        sizes.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
    return (TokenGrid(*sizes), )


def _patch_merging(bindings: TokenGridBindings, path: str,
                   merging: nn.Module) -> None:
    """``PatchMerging(x, input_size)``: ``reduction`` on the merged grid
    (adaptive padding, then the ``nn.Unfold`` sampler's output size)."""
    tokens = TokenGridSource(name=path)

    bindings.set_around(merging, _merged_grid, (tokens, ))
    bindings.bind_all(merging, path, tokens, type(merging).__name__)


def _pair(value) -> Tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _embedded_grid(extra: int, module, args, output) -> tuple:
    _, hw = output
    return (TokenGrid(int(hw[0]), int(hw[1]), extra_tokens=extra), )


def _no_grid(module, args, kwargs) -> tuple:
    return (None, )


def _vision_transformer(bindings: TokenGridBindings, path: str,
                        vit: nn.Module) -> None:
    """``VisionTransformer``: the patch embedding returns ``hw_shape``; the
    layers see ``[cls] + H*W`` tokens (``with_cls_token``)."""
    rule = type(vit).__name__
    tokens = TokenGridSource(name=f'{path}.patch_embed')

    extra = 1 if vit.with_cls_token else 0
    bindings.set_after(vit.patch_embed,
                       functools.partial(_embedded_grid, extra), (tokens, ))
    bindings.set_around(vit, _no_grid, (tokens, ))
    bindings.bind_all(vit.layers, _join(path, 'layers'), tokens, rule)


def _segmenter_head(bindings: TokenGridBindings, path: str,
                    head: nn.Module) -> None:
    """``SegmenterMaskTransformerHead``: ``dec_proj`` and ``patch_proj`` on
    the feature map's grid, the layers on it plus ``num_classes`` trailing
    class embeddings, ``classes_proj`` on the class embeddings alone (no
    grid). ``patch_proj`` and ``classes_proj`` give the class scores.

    mmseg calls a decode head's ``forward`` directly (``loss`` /
    ``predict``), which runs no hooks of the head; so the grid is set from
    the features the segmentor's backbone (or neck) returns, the head's
    input, when they are computed.
    """
    rule = type(head).__name__
    patches = TokenGridSource(name=path)
    layers = TokenGridSource(name=f'{path} (+ class embeddings)')
    producer = getattr(bindings.model, 'neck', None)
    if producer is None:
        producer = getattr(bindings.model, 'backbone', None)
    if producer is None:
        why = ('its grid comes from the segmentor\'s features: bind the '
               'segmentor, not the head alone')
        for name, module in head.named_modules(prefix=path):
            kind = layer_kind(module)
            if kind is not None and not _inside_attention(head, path, name):
                bindings.bind(LinearSite(name, kind, rule=rule, no_grid=why))
        return

    bindings.set_after(
        producer,
        functools.partial(_segmenter_grids, head.input_transform,
                          head.in_index, head.num_classes),
        (patches, layers))
    bindings.bind(LinearSite(_join(path, 'dec_proj'), 'linear', patches, None,
                             1, rule))
    bindings.bind(LinearSite(_join(path, 'patch_proj'), 'linear', patches,
                             None, 1, rule, role=CLASS_SCORES))
    bindings.bind(
        LinearSite(_join(path, 'classes_proj'), 'linear', None, None, 1, rule,
                   no_grid='class embeddings: tokens on no spatial grid',
                   role=CLASS_SCORES))
    bindings.bind_all(head.layers, _join(path, 'layers'), layers, rule)


def _segmenter_grids(input_transform, in_index, num_classes, module, args,
                     output) -> tuple:
    h, w = _head_input_hw(input_transform, in_index, output)
    return TokenGrid(h, w), TokenGrid(h, w, trailing_tokens=num_classes)


def _head_input_hw(input_transform, in_index, inputs) -> Tuple[int, int]:
    """``(H, W)`` of the map a head's ``_transform_inputs(inputs)``
    returns, from the shapes alone (no resize run)."""
    if input_transform == 'resize_concat':
        shape = inputs[in_index[0]].shape
    elif input_transform == 'multiple_select':
        raise ValueError('SegmenterMaskTransformerHead with '
                         "input_transform='multiple_select' has no one grid")
    else:
        shape = inputs[in_index].shape
    return int(shape[-2]), int(shape[-1])


def _join(prefix: str, name: str) -> str:
    return f'{prefix}.{name}' if prefix else name


#: (block classes, rule). Rules of inner blocks bind first where blocks
#: nest (a site keeps the first rule that binds it).
GRID_RULES: Tuple[Tuple[tuple, Callable], ...] = (
    ((MiTEncoderLayer, GSAEncoderLayer), _spatial_reduction_layer),
    ((SwinBlock, LSAEncoderLayer), _hw_shape_layer),
    ((PatchMerging, ), _patch_merging),
    ((VisionTransformer, ), _vision_transformer),
    ((SegmenterMaskTransformerHead, ), _segmenter_head),
)


#: Blocks whose ``forward`` checkpoints its whole inner forward from its
#: first argument when ``with_cp`` is on (``cp.checkpoint(_inner_forward,
#: x)`` in mmseg 1.2.2), which :class:`_CheckpointWithGrids` replaces.
CHECKPOINTED_BLOCKS = (SwinBlock, MiTEncoderLayer, ViTEncoderLayer)


#: module -> (bindings, site) of the bindings installed last on its model.
_SITE_OF: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()

#: Attribute of a segmentor holding its installed bindings
#: (:func:`install_token_grids`); a plain attribute, not in ``state_dict``.
BINDINGS_ATTR = '_gf_token_grids'


def site_of(module: nn.Module) -> Optional[LinearSite]:
    """The site of a Linear / attention of a model whose token grids are
    bound (:func:`bind_token_grids` or :func:`install_token_grids`), or
    None."""
    entry = _SITE_OF.get(module)
    return None if entry is None else entry[1]


def install_token_grids(model: nn.Module) -> Optional[TokenGridBindings]:
    """Bind ``model``'s token grids for good (kept on the model, so that
    its filtered Linears find their grids in every training step).

    Idempotent: returns None when bindings are installed already, else the
    new bindings (``uninstall_token_grids`` takes them off).
    """
    if model.__dict__.get(BINDINGS_ATTR) is not None:
        return None
    bindings = bind_token_grids(model)
    model.__dict__[BINDINGS_ATTR] = bindings
    return bindings


def uninstall_token_grids(model: nn.Module) -> None:
    """Remove what :func:`install_token_grids` installed, if anything."""
    bindings = model.__dict__.pop(BINDINGS_ATTR, None)
    if bindings is not None:
        bindings.remove()


def bind_token_grids(model: nn.Module) -> TokenGridBindings:
    """Hook ``model``'s blocks so that every covered Linear / attention has
    its grid at call time; describe every Linear / attention of the model.

    Returns:
        The bindings: ``sites`` by module path (a layer no rule covers has
        ``source=None`` and ``no_grid`` saying so); ``remove()`` takes the
        hooks off.
    """
    bindings = TokenGridBindings(model)
    modules = list(model.named_modules())
    for classes, rule in GRID_RULES:
        for path, module in modules:
            if isinstance(module, classes):
                rule(bindings, path, module)
    _bind_checkpointed(bindings, modules)
    for path, module in modules:
        kind = layer_kind(module)
        if kind is None or path in bindings.sites or _inside_attention(
                model, '', path):
            continue
        parent = model.get_submodule(path.rpartition('.')[0]) \
            if '.' in path else model
        bindings.sites[path] = LinearSite(
            path, kind, no_grid='no token-grid rule covers it (in a '
            f'{type(parent).__name__}); known blocks: ' + ', '.join(
                cls.__name__ for classes, _ in GRID_RULES
                for cls in classes))
    bindings.publish()
    return bindings


def _bind_checkpointed(bindings: TokenGridBindings, modules) -> None:
    """Recompute :data:`CHECKPOINTED_BLOCKS` with their grids; describe the
    Linears of other modules built with ``with_cp=True`` as on no grid,
    unless the module only passes the flag on to such blocks (mmseg's
    ``MixVisionTransformer`` and ``VisionTransformer`` keep it too)."""
    for path, module in modules:
        if isinstance(module, CHECKPOINTED_BLOCKS):
            bindings.recompute_with_grids(module, path)
        elif getattr(module, 'with_cp', False) is True and not any(
                isinstance(m, CHECKPOINTED_BLOCKS) for m in module.modules()):
            why = (f'it is inside {path or "the model"} '
                   f'({type(module).__name__}), built with with_cp=True, '
                   'whose recompute in the backward would not set its '
                   'grid; build it with with_cp=False')
            for name, site in bindings.sites.items():
                if _under(name, path) and site.no_grid is None:
                    bindings.sites[name] = LinearSite(
                        name, site.kind, token_dim=site.token_dim,
                        rule=site.rule, no_grid=why, role=site.role)


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


def _check_call(site: LinearSite, module: nn.Module,
                args: tuple) -> Optional[str]:
    """Why the traced call does not fit the site's grid, or None."""
    x = args[0]
    try:
        if site.kind == 'linear':
            site.source.grid.token_axis(tuple(x.shape), site.token_dim)
        else:
            batch_first = module.batch_first and x.dim() == 3
            axis = 1 if batch_first else 0
            site.source.grid.token_axis(tuple(x.shape), axis)
            site.key_source.grid.token_axis(tuple(args[1].shape), axis)
    except ValueError as err:
        return f'the traced call does not fit its grid: {err}'
    return None


def _record_call(site: LinearSite, module: nn.Module, args: tuple,
                 kwargs: dict) -> TracedLinear:
    if not args:  # attention called with keywords
        args = (kwargs['query'], kwargs['key'], kwargs['value'])
    shape = tuple(args[0].shape)
    if site.no_grid is not None:
        return TracedLinear(site.path, site.kind, shape, None, None,
                            site.token_dim, site.rule, site.no_grid,
                            site.role)
    if site.source.grid is None or (site.kind == 'attention'
                                    and site.key_source.grid is None):
        return TracedLinear(
            site.path, site.kind, shape, None, None, site.token_dim,
            site.rule, f'its {site.rule} rule set no grid for this call '
            '(called outside its block?)', site.role)
    mismatch = _check_call(site, module, args)
    key_grid = site.key_source.grid if site.kind == 'attention' else None
    return TracedLinear(site.path, site.kind, shape,
                        None if mismatch else site.source.grid,
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


def filtered_module(module: nn.Module, site: LinearSite, radius: int,
                    enabled: bool = True) -> nn.Module:
    """The gradient-filtered replacement of a site's module, sharing its
    Parameters (``GFLinear`` / ``GFMultiheadAttention``).

    Raises:
        ValueError: for a site with no grid, naming it and why.
    """
    if site.no_grid is not None:
        raise ValueError(f'{site.path} cannot be gradient-filtered: '
                         f'{site.no_grid}')
    if site.kind == 'attention':
        return GFMultiheadAttention.from_attention(module, radius,
                                                   site.source,
                                                   site.key_source, enabled)
    return GFLinear.from_linear(module, radius, site.source, site.token_dim,
                                enabled)
