"""The kinds of layer gradient filtering can train, one description each.

A :class:`LayerKind` says everything the rest of the plugin needs to know about
a kind of layer: which module types the selection trace records
(``traced_type``), which of them it can replace (``plain_types``), the filtered
module that replaces them (``filtered_type``, built from a plain one by
``from_plain``, sharing the Parameters), and its geometry at one traced call
(``geometry``), whose ``cost`` method gives the backward FLOPs and the bytes
kept for backward at a radius (:class:`LayerGeometry`). Selection, surgery, the
accounting (kept rules, profile, peak model, budget), the hooks and the tools
go through :func:`layer_kinds` / :func:`kind_of` instead of naming
``nn.Conv2d``. Each kind's math lives in :mod:`mmseg_gf.ops` (the conv's in
``ops/conv/function.py``, its cost in ``ops/conv/cost.py``, the patch-grid
helpers the kinds share in ``ops/patch_grid.py``) and its module in
:mod:`mmseg_gf.models`.

``Conv2d`` (:class:`~.gf_conv.GFConv2d`) is the first kind registered. A
kind on tokens (e.g. ``nn.Linear`` on a token grid) registers the same way:
its ``geometry`` reads the grid from the traced call and its cost is a
1x1-kernel conv's on that grid.

Why a module-level registry and not an mmengine ``Registry``: an mmengine
registry builds objects from config dicts by name, which no kind needs
(configs name the filtered *modules*, registered in ``MODELS`` by
``models/__init__``); the kinds are code-level descriptions that callers
iterate in a fixed order and look up by module type, and this module, like
``gf_conv``, stays importable without the OpenMMLab stack.
"""
from dataclasses import dataclass
from typing import (Callable, Dict, Iterable, List, Optional, Protocol,
                    Sequence, Tuple, Union)

from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from ..ops.conv.cost import ConvBackwardCost, ConvGeometry
from ..patching import plain_class
from .gradient_quality import GradientQuality, layer_gradient_quality
from .gf_conv import GFConv2d, with_mmcv_wrapper

__all__ = ['LayerGeometry', 'LayerKind', 'CONV2D', 'register_layer_kind',
           'unregister_layer_kind', 'layer_kinds', 'layer_kind', 'kind_of',
           'traced_kind_of', 'family_kind_of', 'is_filterable',
           'is_filtered', 'layer_kernels',
           'filterable_names', 'traced_type_names', 'kind_names',
           'layers_noun']


class LayerGeometry(Protocol):
    """What a layer kind's geometry at one call provides.

    Attributes:
        in_shape, out_shape: ``(C, H, W)`` of its input and output on the
            layer's grid (a conv's feature maps; a token layer's grid).
        map_area: positions of the map its output covers, for the output
            stride (the ``'auto'`` radius, the budget's refinement order):
            a conv's output map; a Swin window Linear's windows together.
    """

    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    map_area: int

    def cost(self, radius: int, batch: int = 1,
             need_input_grad: bool = True, need_weight_grad: bool = True,
             elem_bytes: int = 4,
             collapse_dilated: bool = False) -> ConvBackwardCost:
        """Backward FLOPs and bytes kept, exact and filtered at ``radius``."""

    def describe(self) -> str:
        """Its hyper-parameters in a table cell (a conv's ``k/s/d/g``)."""


@dataclass(frozen=True)
class LayerKind:
    """A kind of layer that gradient filtering can train.

    Attributes:
        name: its name in tables and records (``'conv2d'``).
        noun: what messages call one layer of it (``'conv'``).
        traced_type: the selection trace records every instance of it
            (subclasses too, so that a subclass with its own forward is
            named in the error that refuses it).
        plain_types: the exact classes whose forward the filtered module
            computes (also behind a lean swap: ``plain_class``).
        filtered_type: the filtered module class, a
            :class:`~.filtered_layer.FilteredLayer` (its ``radius``,
            ``enabled``, ``_filter_active`` and patch partitions).
        from_plain: ``(module, radius, enabled) -> filtered module``: the
            filtered layer built from a plain one, sharing its Parameters
            (so optimizers and ``state_dict`` stay valid).
        geometry: ``(module, inputs, output) -> LayerGeometry`` of one call
            (``inputs``: its positional inputs, as a forward hook gets them).
        quality: ``(module, x, grad_out, radius) -> GradientQuality``: the
            filtered gradients against the exact ones at one call
            (:mod:`mmseg_gf.models.gradient_quality`).
        allowed: the classes it accepts, for error messages.
        prepare: ``(model) -> undo or None``: installs on the segmentor what
            ``geometry`` and ``from_plain`` need during the selection's trace
            (the Linear kinds: the token-grid hooks); None when nothing is
            needed or it is installed already.
        install: ``(model) -> None``: installs it for training (the
            surgery calls it before ``from_plain``); idempotent.
        patch_partitioned: its filtered call tags its output with the
            ``r x r`` patch partition of its grid and its ``g_x`` is
            constant on those patches, so an elementwise op between two
            such layers may keep patch means of its derivative
            (:mod:`.patch_mean_graph`; docs/gradient_filter.md
            #elementwise-ops-between-filtered-layers).
        call_grids: a kind on tokens: ``(module, site, args, kwargs) ->
            ((grid, input shape, token axis), ...)``, the grids one call of
            ``module`` reads (the query's first, an attention's keys
            second; a grid is None where its site's source holds none).
            Its layers are those the token-grid bindings describe
            (:mod:`.token_grids`); None for a kind on feature maps.
        kept_rule: what one call of its layers keeps for backward
            (``rule(path, module, x, out, shared) -> items, or None`` when
            another rule decides, :mod:`mmseg_gf.accounting.kept`): a
            function, or its ``'package.module:function'`` name where the
            rule lies in the accounting, a layer above the models.
        frozen_lean: the lean variant (:data:`mmseg_gf.models.lean.LEAN_KINDS`)
            its plain layers take while frozen in the lean region
            (``'frozen_conv'``: keeps nothing when its input needs no
            gradient), or None.
        claims: ``(module) -> bool`` for a kind narrower than its traced
            type (depthwise convs as a kind of their own beside
            ``conv2d``): it takes the instances of ``traced_type`` it
            claims, ahead of the kinds that claim every instance (None).
        family: the class of every layer of its sort, wider than
            ``traced_type`` where layers of that sort exist that no kind
            filters (a conv kind's: ``_ConvNd``, transposed and 1-D convs
            too): the launch count files their launches under
            ``category``, the cost report lists them among the layers it
            does not count. None: ``traced_type``.
        category: what the launch count
            (:data:`mmseg_gf.accounting.launches.KINDS`) files the
            launches of its family's layers under (``'conv'``,
            ``'linear'``, ``'attention'``), ``'filtered_' + category``
            while one of its filtered layers filters, where the count has
            that category.
        kernel: ``(module) -> Tensor``: a layer's weight as a kernel over
            its grid's axes (``C_out x C_in/groups x k...``), whose
            DC-energy ratio (paper Eq. 13,
            :func:`~mmseg_gf.models.gradient_quality.dc_energy_ratios`) Proposition 1
            relies on; None for a kind without one (a Linear, an
            attention).
    """

    name: str
    noun: str
    traced_type: type
    plain_types: Tuple[type, ...]
    filtered_type: type
    from_plain: Callable[[nn.Module, int, bool], nn.Module]
    geometry: Callable[[nn.Module, Sequence, Tensor], LayerGeometry]
    quality: Callable[[nn.Module, Tensor, Tensor, int], GradientQuality]
    allowed: str
    prepare: Optional[Callable[[nn.Module], Optional[Callable[[], None]]]] \
        = None
    install: Optional[Callable[[nn.Module], None]] = None
    patch_partitioned: bool = False
    call_grids: Optional[Callable[..., tuple]] = None
    kept_rule: Union[str, Callable, None] = None
    frozen_lean: Optional[str] = None
    claims: Optional[Callable[[nn.Module], bool]] = None
    family: Optional[type] = None
    category: str = 'other'
    kernel: Optional[Callable[[nn.Module], Tensor]] = None

    def in_family(self, module: nn.Module) -> bool:
        """Whether ``module`` is a layer of this kind's sort (its
        :attr:`family`), filterable or not."""
        return isinstance(module, self.family or self.traced_type)

    def traces(self, module: nn.Module) -> bool:
        """Whether this kind's trace records ``module``."""
        return isinstance(module, self.traced_type) and (
            self.claims is None or bool(self.claims(module)))

    def is_filterable(self, module: nn.Module) -> bool:
        """Whether this kind can filter ``module`` (plain or filtered)."""
        plain = plain_class(module)
        return plain in self.plain_types or isinstance(module,
                                                       self.filtered_type)

    def is_filtered(self, module: nn.Module) -> bool:
        """Whether ``module`` is this kind's filtered module."""
        return isinstance(module, self.filtered_type)

    def set_filter(self, module: nn.Module, radius: int,
                   enabled: bool) -> nn.Module:
        """``module`` filtered at ``radius`` (``enabled=False``: the exact
        backward): a filtered module is updated in place, a plain one
        replaced by its filtered layer (:attr:`from_plain`)."""
        if self.is_filtered(module):
            module.radius, module.enabled = radius, enabled
            return module
        return self.from_plain(module, radius, enabled)


_KINDS: Dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind) -> LayerKind:
    """Add a kind (after those registered before it).

    Raises:
        ValueError: a kind of that name exists, or one that traces every
            instance of the same type while this one does too (a kind
            with ``claims`` narrows a type another kind traces).
    """
    for other in _KINDS.values():
        if other.name == kind.name or (
                other.traced_type is kind.traced_type
                and other.claims is None and kind.claims is None):
            raise ValueError(f'layer kind {kind.name!r} clashes with the '
                             f'registered kind {other.name!r}')
    _KINDS[kind.name] = kind
    return kind


def unregister_layer_kind(name: str) -> None:
    """Remove the kind called ``name``, if registered (a kind registered
    for a while, e.g. by a test)."""
    _KINDS.pop(name, None)


def layer_kinds() -> List[LayerKind]:
    """The registered kinds, in registration order."""
    return list(_KINDS.values())


def layer_kind(name: str) -> LayerKind:
    """The kind called ``name``.

    Raises:
        KeyError: no such kind (the message names the registered ones).
    """
    if name not in _KINDS:
        raise KeyError(f'no layer kind {name!r}; registered: {list(_KINDS)}')
    return _KINDS[name]


def traced_kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind whose trace records ``module`` (filterable or not), or
    None: a kind that claims it (:attr:`LayerKind.claims`) first, else the
    first registered kind of its type."""
    narrow = [k for k in _KINDS.values() if k.claims is not None]
    for kind in narrow + [k for k in _KINDS.values() if k.claims is None]:
        if kind.traces(module):
            return kind
    return None


def family_kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind whose trace records ``module``, else the first registered
    kind whose family holds it (a transposed conv: the conv's), or None."""
    kind = traced_kind_of(module)
    if kind is not None:
        return kind
    return next((k for k in _KINDS.values() if k.in_family(module)), None)


def layer_kernels(model: nn.Module) -> List[Tuple[str, Tensor]]:
    """``(path, kernel)`` of every layer of ``model`` whose kind has a
    :attr:`~LayerKind.kernel` (filterable or not, e.g. a weight-standardised
    conv: what the DC-energy ratio describes is the kernel), in module
    order."""
    found = []
    for path, module in model.named_modules():
        kind = traced_kind_of(module)
        if kind is not None and kind.kernel is not None:
            found.append((path, kind.kernel(module)))
    return found


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind that can filter ``module``, or None."""
    kind = traced_kind_of(module)
    return kind if kind is not None and kind.is_filterable(module) else None


def is_filterable(module: nn.Module) -> bool:
    """Whether some kind can filter ``module``."""
    return kind_of(module) is not None


def is_filtered(module: nn.Module) -> bool:
    """Whether ``module`` is a kind's filtered module (enabled or not)."""
    return any(k.is_filtered(module) for k in _KINDS.values())


def kind_names() -> Tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_KINDS)


def traced_type_names() -> str:
    """The traced types of every kind (``'nn.Conv2d'``), for messages."""
    def name(t: type) -> str:
        torch_nn = t.__module__.startswith('torch.nn')
        return ('nn.' if torch_nn else '') + t.__name__
    types = dict.fromkeys(k.traced_type for k in _KINDS.values())
    return ' or '.join(name(t) for t in types)


def layers_noun(kinds: Iterable[str]) -> str:
    """What messages call layers of the kinds named ``kinds``: ``'convs'``
    when every one is a conv (:data:`CONV2D`, the paper's layers; none
    given too), else ``'layers'``."""
    return 'convs' if set(kinds) <= {CONV2D.name} else 'layers'


def filterable_names() -> str:
    """What every kind accepts, for error messages."""
    return '; '.join(k.allowed for k in _KINDS.values())


def _conv_geometry(module: nn.Module, inputs: Sequence,
                   output: Tensor) -> ConvGeometry:
    return ConvGeometry.of(module, inputs[0].shape[1:], output.shape[1:])


def _conv_kernel(module: nn.Module) -> Tensor:
    return module.weight


def _conv_from_plain(module: nn.Module, radius: int,
                     enabled: bool) -> GFConv2d:
    return GFConv2d.from_conv(module, radius, enabled=enabled)


#: ``nn.Conv2d`` (and mmcv's wrapper of it): the paper's layers.
CONV2D = register_layer_kind(LayerKind(
    name='conv2d',
    noun='conv',
    traced_type=nn.Conv2d,
    plain_types=with_mmcv_wrapper(nn.Conv2d),
    filtered_type=GFConv2d,
    from_plain=_conv_from_plain,
    geometry=_conv_geometry,
    quality=layer_gradient_quality,
    allowed='nn.Conv2d, mmcv Conv2d, GFConv2d (not e.g. ConvWS, '
    'DeformConv, ConvTranspose)',
    patch_partitioned=True,
    kept_rule='mmseg_gf.accounting.kept:conv_items',
    frozen_lean='frozen_conv',
    family=_ConvNd,
    category='conv',
    kernel=_conv_kernel))
