"""The kinds of layer gradient filtering can train, one description each.

Selection, surgery, the accounting, the hooks and the tools ask
:func:`layer_kinds` / :func:`kind_of` instead of naming ``nn.Conv2d``.
A module-level registry, not an mmengine ``Registry``: no kind is built
from a config, callers iterate the kinds in a fixed order, and the module
stays importable without the OpenMMLab stack."""
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
    """A layer kind's geometry at one call: ``(C, H, W)`` shapes on its grid,
    and ``map_area``, the positions its output covers."""

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
        name, noun: its name in tables (``'conv2d'``), one layer in messages.
        traced_type: recorded by the selection trace, subclasses too (so that
            the refusal names them).
        plain_types: the exact classes whose forward the filtered module
            computes.
        from_plain: ``(module, radius, enabled) -> filtered module`` sharing
            its Parameters (optimizers and ``state_dict`` stay valid).
        geometry: ``(module, inputs, output) -> LayerGeometry`` of one call.
        quality: ``(module, x, grad_out, radius) -> GradientQuality``.
        prepare: ``(model) -> undo or None``: what ``geometry`` and
            ``from_plain`` need during the trace (token-grid hooks).
        install: ``(model) -> None``, idempotent, before ``from_plain``.
        patch_partitioned: its ``g_x`` is patch-constant
            (:mod:`.patch_mean_graph`).
        call_grids: a token kind's ``(module, site, args, kwargs) -> ((grid,
            input shape, token axis), ...)`` (query first); None on maps.
        kept_rule: its kept-for-backward rule (:mod:`mmseg_gf.accounting.kept`),
            a function or a ``'package.module:function'`` name.
        frozen_lean: the lean variant its frozen plain layers take, or None.
        claims: ``(module) -> bool`` for a kind narrower than its traced type
            (depthwise convs), ahead of the kinds that claim every instance.
        family: the class of every layer of its sort (default ``traced_type``).
        category: the launch count's category for its family.
        kernel: ``(module) -> Tensor``: the weight as a kernel over its grid's
            axes, for the DC-energy ratio (paper Eq. 13); None without one."""

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
        """``module`` filtered at ``radius``: updated in place, or a plain one
        replaced by its filtered layer."""
        if self.is_filtered(module):
            module.radius, module.enabled = radius, enabled
            return module
        return self.from_plain(module, radius, enabled)


_KINDS: Dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind) -> LayerKind:
    """Add a kind (after those registered before it).

    Raises:
        ValueError: a kind of that name exists, or both trace every instance
            of the same type."""
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
    """The kind whose trace records ``module``, or None; a kind that claims
    it first."""
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
    """``(path, kernel)`` of every layer whose kind has a kernel, filterable
    or not, in module order."""
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
    """``'convs'`` when every kind named is a conv (or none given), else
    ``'layers'``."""
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
