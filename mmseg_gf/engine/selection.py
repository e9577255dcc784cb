"""Which layers to gradient-filter, and with which patch size: the policy.

Chooses, from the selection trace (:mod:`.layer_trace`), the last N layers
that feed the output or named module paths, each with its radius.
Classifiers are always trained and never counted unless named; which ones
they are per family is in docs/settings.md.
"""
import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn

from ..models.layer_kinds import (CONV2D, filterable_names, kind_names,
                                  kind_of, layers_noun, traced_kind_of,
                                  traced_type_names)
from ..models.segmentor import (CLASSIFIER_NAMES, is_class_score_layer,
                                is_classifier, is_head_classifier,
                                unwrap_model)
from ..ops import MAX_RADIUS, check_radius
from ..ops.conv.cost import map_output_stride
# The tracer's names, importable from here too.
from .layer_trace import (LayerRecord, head_list,  # noqa: F401
                          nested_tensors, trace_layers)

RadiusSetting = Union[int, str, Dict[str, Union[int, str]]]

__all__ = [
    'LayerRecord', 'LayerChoice', 'trace_layers', 'select_layers',
    'auto_radius', 'resolve_radius', 'check_radius_paths',
    'radius_over_map', 'check_layer_kinds', 'has_grid', 'check_input_size', 'MAX_INPUT_SIDE'
]


def check_layer_kinds(layer_kinds) -> Tuple[str, ...]:
    """Validate ``layer_kinds``: None (every kind) or a non-empty list of
    kinds.

    Returns:
        the kind names, in registration order.

    Raises:
        ValueError: naming the allowed values.
    """
    allowed = kind_names()
    if layer_kinds is None:
        return allowed
    if isinstance(layer_kinds, str):
        layer_kinds = (layer_kinds, )
    names = list(layer_kinds) if isinstance(layer_kinds,
                                            (list, tuple)) else None
    if not names or any(n not in allowed for n in names):
        raise ValueError(
            'gradient_filter layer_kinds must be None (every kind) or a '
            f'non-empty list of {list(allowed)} (e.g. [\'conv2d\']: the '
            f'paper\'s conv-only count), got {layer_kinds!r}')
    return tuple(n for n in allowed if n in names)


#: The largest side of the selection trace's input (``input_size``): the
#: trace runs the segmentor once at that size, so a size past any image a
#: segmentor is trained on would only reach the allocator.
MAX_INPUT_SIDE = 8192


def check_input_size(size) -> Tuple[int, int]:
    """Validate ``input_size``: an int or ``(H, W)``, sides in
    ``[1, MAX_INPUT_SIDE]``.

    Raises:
        ValueError: naming the setting, the value and the range.
    """
    pair = (size, size) if isinstance(size, int) else size
    if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool)
            and 1 <= v <= MAX_INPUT_SIDE for v in pair):
        raise ValueError(
            'gradient_filter input_size must be (H, W) ints in '
            f'[1, {MAX_INPUT_SIDE}] (the size of the selection trace), got '
            f'{size!r}')
    return int(pair[0]), int(pair[1])


@dataclass
class LayerChoice:
    """One selected layer: its path, module, shapes, geometry and radius."""

    path: str
    module: nn.Module
    radius: int
    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    geometry: Any
    norm_path: Optional[str] = None
    input_hw: Tuple[int, int] = field(default=(0, 0))
    kind: str = CONV2D.name

    @property
    def output_stride(self) -> int:
        """Input-image pixels per output pixel of this layer."""
        return map_output_stride(self.input_hw, self.geometry.map_area)


def radius_over_map(choice: LayerChoice) -> Optional[str]:
    """Why ``choice``'s radius exceeds its traced output map, or None.

    Valid, but seldom meant: the gradient is then averaged over the whole side.
    """
    _, h, w = choice.out_shape
    if choice.radius <= h and choice.radius <= w:
        return None
    crop = ('' if not choice.input_hw[0] else
            f' at the {choice.input_hw[0]}x{choice.input_hw[1]} input')
    return (f'gradient_filter radius {choice.radius} of {choice.path!r} is '
            f'larger than its {h}x{w} output map{crop}: one patch covers '
            f'the whole map along that side (patches that fit: radius '
            f'{min(h, w)} or less)')


def auto_radius(output_stride: int) -> int:
    """The 'auto' radius: stride <= 4 -> 8, 8 -> 4, >= 16 -> 2.

    A patch then covers about 32 image pixels at every level, as in the
    reference UPerNet setting; dilation is ignored.
    """
    if output_stride <= 4:
        return 8
    if output_stride <= 8:
        return 4
    return 2


def _prefix_match(path: str, prefix: str) -> bool:
    return prefix in ('', '*') or path == prefix or path.startswith(prefix +
                                                                    '.')


def resolve_radius(radius: RadiusSetting, path: str,
                   output_stride: int) -> int:
    """The radius of one layer from the ``radius`` setting.

    ``radius``: an int, ``'auto'``, or ``{path prefix: int or 'auto'}`` where
    the longest prefix matching whole path components wins and ``'*'`` is the
    fallback.

    Raises:
        ValueError: bad value, or a dict with no key matching ``path``.
    """
    if isinstance(radius, dict):
        keys = [k for k in radius if _prefix_match(path, k)]
        if not keys:
            raise ValueError(
                f'gradient_filter radius: no key of {sorted(radius)} matches '
                f'layer {path!r}; add a prefix of it or a "*" fallback')
        best = max(keys, key=lambda k: -1 if k == '*' else len(k))
        return resolve_radius(radius[best], path, output_stride)
    if radius == 'auto':
        return auto_radius(output_stride)
    if isinstance(radius, str):
        raise ValueError(
            "gradient_filter radius must be an int >= 1, 'auto' or a dict "
            f'{{path: int or "auto"}} (ints at most {MAX_RADIUS}), got '
            f'{radius!r}')
    return check_radius(radius)


def check_radius_paths(model: nn.Module, radius: RadiusSetting) -> None:
    """Refuse a ``radius`` key that is no module path of ``model`` (a typo).

    Raises:
        ValueError: naming the key, close matches and the allowed keys.
    """
    if not isinstance(radius, dict):
        return
    paths = [n for n, _ in model.named_modules() if n]
    known = set(paths)
    for key in radius:
        if key in ('', '*') or (isinstance(key, str) and key in known):
            continue
        close = difflib.get_close_matches(str(key), paths, n=3)
        hint = f'; did you mean {close}?' if close else ''
        raise ValueError(
            f'gradient_filter radius: no module {key!r} in '
            f'{type(model).__name__}{hint}; allowed keys: \'*\' (the '
            'fallback) or module paths of the model (a layer or a '
            'container of layers, e.g. \'decode_head\'), values: an int '
            '>= 1 or \'auto\'')


def _check_filterable(path: str, module: nn.Module) -> None:
    if kind_of(module) is None:
        traced = traced_kind_of(module)
        allowed = filterable_names() if traced is None else traced.allowed
        raise ValueError(
            f'gradient_filter layers: {path!r} is a '
            f'{type(module).__name__}, which cannot be gradient-filtered; '
            f'allowed: {allowed}')


def _listing(paths: Sequence[str], limit: int = 6) -> str:
    more = f' and {len(paths) - limit} more' if len(paths) > limit else ''
    return f'{list(paths[:limit])}{more}'


def select_layers(model: nn.Module,
                  num_layers: Optional[int] = None,
                  layers: Optional[Sequence[str]] = None,
                  radius: RadiusSetting = 4,
                  input_size: Sequence[int] = (512, 512),
                  records: Optional[List[LayerRecord]] = None,
                  layer_kinds: Optional[Sequence[str]] = None
                  ) -> List[LayerChoice]:
    """Choose the layers to gradient-filter.

    Exactly one of ``num_layers`` / ``layers`` must be given.

    Args:
        model: an mmseg segmentor (unwrapped or wrapped).
        num_layers: the last N layers in execution order that the output's
            loss gradient reaches, classifiers excluded.
        layers: module paths; a container stands for every layer inside that
            some loss gradient reaches (a classifier only when named).
        radius: see :func:`resolve_radius`.
        input_size: ``(H, W)`` of the trace.
        records: a precomputed :func:`trace_layers` result (``grad=False``).
        layer_kinds: the kinds counted (:func:`check_layer_kinds`; None: all).

    Returns:
        list[LayerChoice]: in execution order.

    Raises:
        ValueError: bad ``num_layers``, no classifier, unknown path (with
            close matches), a named layer no loss gradient reaches or that
            cannot be filtered, no layer at all, bad radius.
    """
    if (num_layers is None) == (layers is None):
        raise ValueError('gradient_filter: give exactly one of num_layers '
                         f'and layers, got num_layers={num_layers!r}, '
                         f'layers={layers!r}')
    kinds = check_layer_kinds(layer_kinds)
    input_size = check_input_size(input_size)
    model = unwrap_model(model)
    check_radius_paths(model, radius)
    if records is None or any(r.feeds_output is None for r in records):
        records = trace_layers(model, input_size)
    ran_kinds = sorted({r.kind for r in records if r.inference and
                        has_grid(r) and not is_classifier(r.path)},
                       key=list(kind_names()).index)
    records = [r for r in records if r.kind in kinds or is_classifier(r.path)]
    if not records:
        raise ValueError(
            f'gradient_filter: {type(model).__name__} ran no '
            f'{traced_type_names()} on its inference path; nothing can be '
            'gradient-filtered')
    if num_layers is not None:
        chosen = _last_n_layers(model, records, num_layers,
                                _KindNote(kinds, ran_kinds))
    else:
        chosen = _named_layers(model, records, layers,
                               _KindNote(kinds, ran_kinds))
    choices = [_layer_choice(rec, radius, input_size) for rec in chosen]
    check_radius_keys_used(radius, [c.path for c in choices])
    return choices


@dataclass
class _KindNote:
    """The ``layer_kinds`` setting and the kinds the model runs, for errors."""

    kinds: Tuple[str, ...]
    ran: List[str]

    def nouns(self) -> str:
        return f'layer of the kinds {list(self.kinds)}'

    def text(self) -> str:
        return (f'layer_kinds={list(self.kinds)}; the kinds it runs besides '
                f'its classifiers: {self.ran}; allowed: layer_kinds among '
                'those, or None for every kind')


def check_radius_keys_used(radius: RadiusSetting,
                           paths: Sequence[str]) -> None:
    """Refuse a ``radius`` key (not ``'*'``) that matches no selected layer.

    Raises:
        ValueError: naming the key and the selected layers.
    """
    if not isinstance(radius, dict):
        return
    for key in radius:
        if key in ('', '*') or any(_prefix_match(p, key) for p in paths):
            continue
        inside = [p for p in paths if str(key).startswith(p + '.')]
        why = (f'it is a part of the selected layer {inside[0]!r}, whose '
               f'radius applies to the whole layer; use the key '
               f'{inside[0]!r}' if inside else
               'it names no selected layer and no container of one')
        raise ValueError(
            f'gradient_filter radius: key {key!r} would be ignored: {why}. '
            f'Selected layers: {_listing(list(paths))}; allowed keys: \'*\' '
            'or a prefix of a selected layer\'s path')


def _last_n_layers(model: nn.Module, records: List[LayerRecord],
                   num_layers, note: '_KindNote') -> List[LayerRecord]:
    """The last ``num_layers`` layers that feed the output, classifiers
    excluded."""
    name = type(model).__name__
    classifiers = [
        r.path for r in records
        if is_classifier(r.path) and r.inference and r.feeds_output
    ]
    if not classifiers:
        heads = [type(m).__name__ for m in head_list(model.decode_head)]
        raise ValueError(
            f'gradient_filter: the decode head of {name} ({heads}) has '
            'no classifier (conv_seg, fc_seg, or the class-score Linears '
            'of Segmenter, patch_proj / classes_proj, and SAN, '
            'rec_with_attnbias.proj) that the output depends '
            'on; gradient filtering always trains it: its class scores come '
            'from layers that num_layers cannot select, so they would stay '
            "frozen. Allowed: a segmentor whose decode heads end in mmseg's "
            'conv_seg or class-score projections')
    ran = [r for r in records if r.inference and not is_classifier(r.path)]
    # Linears on no token grid (CGNet's global-context FCs on pooled
    # features, SE blocks) are not counted and stay frozen
    gridless = [r.path for r in ran if not has_grid(r)]
    ran = [r for r in ran if has_grid(r)]
    pool = [r for r in ran if r.feeds_output]
    unreached = [r.path for r in ran if not r.feeds_output]
    if not pool:
        raise ValueError(
            f'gradient_filter: {name} runs no {note.nouns()} on its '
            'inference path that the output depends on besides its '
            f'classifiers {classifiers}, so num_layers has nothing to choose '
            f'from ({note.text()}; to train the classifier alone, use '
            'CalibrationHook(trainable=[...]) as '
            'configs/_base_/strategies/classifier_only.py does)')
    if isinstance(num_layers, bool) or not isinstance(
            num_layers, int) or not 1 <= num_layers <= len(pool):
        note = (f'; not counted, as no gradient of the output reaches '
                f'them: {_listing(unreached)}' if unreached else '')
        if gridless:
            note += ('; not counted, as their tokens lie on no grid: '
                     f'{_listing(gridless)}')
        raise ValueError(
            f'gradient_filter num_layers must be an int in '
            f'[1, {len(pool)}] ({name} runs {len(pool)} {_nouns(pool)} '
            'besides '
            f'the classifier that the output depends on{note}), got '
            f'{num_layers!r}')
    return pool[-num_layers:]


def _nouns(recs: Sequence[LayerRecord]) -> str:
    """``'convs'`` when every record is a conv, else ``'layers'``."""
    return layers_noun(r.kind for r in recs)


def has_grid(rec: LayerRecord) -> bool:
    """Whether a traced layer can be filtered: a conv, or tokens on a grid."""
    return getattr(rec.geometry, 'grid', True) is not None


def _refuse_no_grid(recs: Sequence[LayerRecord], setting: str) -> None:
    if recs:
        why = getattr(recs[0].geometry, 'no_grid', None)
        raise ValueError(
            f'gradient_filter {setting}: {_listing([r.path for r in recs])} '
            f'take tokens on no spatial grid ({why}), so they cannot be '
            "gradient-filtered; allowed: a layer on a grid or a container "
            '(which skips them)')


def _named_layers(model: nn.Module, records: List[LayerRecord],
                  layers, note: _KindNote) -> List[LayerRecord]:
    """The convs that ``layers`` (module paths) name, in execution order."""
    if isinstance(layers, str):
        layers = [layers]
    if not layers:
        raise ValueError('gradient_filter layers must be a non-empty '
                         'list of module paths')
    modules = dict(model.named_modules())
    chosen: List[LayerRecord] = []
    for path in layers:
        if not isinstance(path, str) or not path.strip('.'):
            raise ValueError(
                f'gradient_filter layers: {path!r} is no module path '
                '(allowed: dotted paths of modules of the segmentor, e.g. '
                "'backbone.layer4' or 'decode_head'; the whole segmentor is "
                'not a choice: use num_layers)')
        reached = _convs_reached_in(model, modules, records, path, note)
        named = [r for r in reached if r.path == path]
        # a Linear on no grid: refused when named, skipped in a container
        _refuse_no_grid([r for r in named if not has_grid(r)], 'layers')
        for rec in reached:
            if rec not in chosen and has_grid(rec):
                chosen.append(rec)
    order = {id(r): i for i, r in enumerate(records)}
    return sorted(chosen, key=lambda r: order[id(r)])


def _convs_reached_in(model: nn.Module, modules: Dict[str, nn.Module],
                      records: List[LayerRecord], path: str,
                      note: _KindNote) -> List[LayerRecord]:
    """The convs at or inside ``path`` that some loss gradient reaches."""
    if path not in modules:
        close = difflib.get_close_matches(path, list(modules), n=3)
        hint = f'; did you mean {close}?' if close else ''
        raise ValueError(f'gradient_filter layers: no module {path!r} in '
                         f'{type(model).__name__}{hint}')
    if is_classifier(path) or is_head_classifier(path):
        which = 'a decode' if is_classifier(path) else 'an auxiliary'
        raise ValueError(
            f'gradient_filter layers: {path!r} is {which} head\'s '
            'classifier (class scores); no head\'s classifier is ever '
            'gradient-filtered (a decode head\'s is trained with its exact '
            'gradient by every setting); allowed: the layers before it. '
            'To train the classifier alone, use '
            'CalibrationHook(trainable=[...]) as '
            'configs/_base_/strategies/classifier_only.py does')
    mod = modules[path]
    inside = [
        r for r in records
        if r.path == path or (r.path.startswith(path + '.') and
                              r.path.split('.')[-1] not in CLASSIFIER_NAMES
                              and not is_class_score_layer(r.path))
    ]
    if not inside:
        kind = traced_kind_of(mod)
        if kind is not None:
            raise ValueError(f'gradient_filter layers: {kind.noun} {path!r} '
                             'never runs in the forward pass')
        raise ValueError(
            f'gradient_filter layers: {path!r} ({type(mod).__name__}) '
            f'contains no {note.nouns()} that runs in the forward pass '
            f'({note.text()}); allowed: such a layer or a container of '
            'them')
    reached = [r for r in inside if r.feeds_heads]
    if not reached:
        raise ValueError(
            f'gradient_filter layers: no loss gradient reaches {path!r}: no '
            f'head output depends on {_listing([r.path for r in inside])} '
            'through autograd (used under torch.no_grad or detached, e.g. '
            "EMANet's ema_mid_conv), so training it would change nothing; "
            'allowed: convs that the output or a head depends on')
    return reached


def _layer_choice(rec: LayerRecord, radius: RadiusSetting,
                  input_size: Sequence[int]) -> LayerChoice:
    """A traced layer as a :class:`LayerChoice` with its radius resolved."""
    _check_filterable(rec.path, rec.module)
    layer = rec.module
    h, w = int(input_size[0]), int(input_size[1])
    return LayerChoice(
        path=rec.path,
        module=layer,
        radius=resolve_radius(radius, rec.path,
                              map_output_stride((h, w),
                                                rec.geometry.map_area)),
        in_shape=rec.in_shape,
        out_shape=rec.out_shape,
        geometry=rec.geometry,
        norm_path=rec.norm_path,
        input_hw=(h, w),
        kind=rec.kind)
