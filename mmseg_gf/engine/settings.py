"""The gradient-filter settings, declared once.

The config rewrite, ``GradFilterModel``, ``GradFilterHook`` and the tools
take the same settings: each is one field of
:class:`GradientFilterSettings` with its default, check and doc, and the
key lists and defaults are read off the fields. Every error names the
setting, its value and what is allowed, before any model is built.
"""
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..accounting.budget import check_budget
from ..ops import MAX_RADIUS, check_radius
from .selection import check_input_size, check_layer_kinds
from .surgery import check_mode

__all__ = [
    'GradientFilterSettings', 'as_settings', 'check_settings',
    'SETTING_KEYS', 'FLAGS',
    'SURGERY_FLAGS', 'CHOICE_KEYS', 'DEFAULTS', 'DEFAULT_RADIUS',
    'DEFAULT_INPUT_SIZE', 'HookOption', 'HOOK_OPTIONS', 'ACCEPTED_KEYS',
    'setting_docs'
]

DEFAULT_RADIUS = 4
DEFAULT_INPUT_SIZE = (512, 512)
#: The settings that choose the layers: exactly one is given.
CHOICE_KEYS = ('num_layers', 'layers', 'budget')


def _num_layers(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f'gradient_filter num_layers must be an int >= 1, got {n!r}')
    return n


def _layers(layers: Any) -> List[str]:
    paths = [layers] if isinstance(layers, str) else layers
    if not paths or not all(isinstance(p, str) for p in paths):
        raise ValueError('gradient_filter layers must be a non-empty '
                         f'list of module paths, got {layers!r}')
    return list(paths)


def _radius(radius: Any) -> Any:
    values = radius.values() if isinstance(radius, dict) else [radius]
    for r in values:
        if r != 'auto':
            try:
                check_radius(r)
            except ValueError:
                raise ValueError(
                    "gradient_filter radius must be an int >= 1, 'auto' or "
                    'a dict {module path: int or "auto"} (ints at most '
                    f'{MAX_RADIUS}), got {radius!r}') from None
    # a copy: the settings do not share the caller's dict
    return dict(radius) if isinstance(radius, dict) else radius


def _layer_kinds(kinds: Any) -> List[str]:
    return list(check_layer_kinds(kinds))


def _setting(default: Any, doc: str,
             check: Optional[Callable[[Any], Any]] = None,
             surgery: bool = False):
    """A field: its default, its doc and the check that normalises its
    value."""
    return field(default=default,
                 metadata=dict(doc=doc, check=check, surgery=surgery))


@dataclass(frozen=True)
class GradientFilterSettings:
    """Which layers gradient filtering trains and how; checked when made.

    Frozen: a dict is checked once and this object passed down; a value
    derived later is a new object, so no caller's settings change under it.
    """
    num_layers: Optional[int] = _setting(
        None, 'train the last N layers of `layer_kinds` (execution order)',
        _num_layers)
    layers: Optional[List[str]] = _setting(
        None, 'or these module paths (a container: every layer inside)',
        _layers)
    budget: Optional[Dict[str, Any]] = _setting(
        None, 'or limits the choice of N and radii must fit, e.g. '
        'dict(saved_mib=300) (mmseg_gf.accounting.budget)', check_budget)
    radius: Any = _setting(
        None, "int, 'auto' or {path prefix: int | 'auto'}; default 4 (not "
        'with a budget: its radii)', _radius)
    mode: str = _setting(
        'gf', "'gf' or 'vanilla' (the same layers, exact backward)",
        check_mode)
    train_norm: bool = _setting(
        False, 'also train the norms following the chosen layers',
        surgery=True)
    lean: bool = _setting(
        True, 'keep only what each backward needs around the trained '
        'layers (docs/lean_region.md)', surgery=True)
    input_size: Optional[Tuple[int, int]] = _setting(
        None, '(H, W) of the selection trace; default: the config\'s '
        'data_preprocessor size / crop_size, else 512', check_input_size)
    keep_frozen_aux_heads: bool = _setting(
        False, 'run auxiliary heads whose loss trains nothing (default: '
        'left out of training steps)', surgery=True)
    log_frozen_aux_losses: bool = _setting(
        False, 'still log those heads\' losses, computed without autograd',
        surgery=True)
    reuse_cpu_memory: bool = _setting(
        False, 'training on CPU: keep freed memory in malloc\'s heap for '
        'the next steps (mmseg_gf.engine.cpu_memory)')
    layer_kinds: Optional[List[str]] = _setting(
        None, "the kinds of layer counted (['conv2d']: the paper's count); "
        'default: every registered kind', _layer_kinds)
    patch_mean_activations: bool = _setting(
        True, 'with lean and mode=\'gf\': a GELU between two filtered '
        'layers on one patch partition keeps the patch means of its '
        'derivative where the traced step shows that exact')

    def __post_init__(self) -> None:
        out = self.as_dict()
        _check_all(out)
        for key, value in out.items():
            object.__setattr__(self, key, value)  # frozen: set once here

    @classmethod
    def from_dict(cls, settings: Any) -> 'GradientFilterSettings':
        """Checked settings from a dict with keys among :data:`SETTING_KEYS`.

        Raises:
            ValueError: not a dict, an unknown key, or a refused setting.
        """
        if not isinstance(settings, dict):
            raise ValueError(
                'gradient_filter must be a dict, e.g. dict(num_layers=5, '
                f'radius=4), with keys among {list(SETTING_KEYS)}; got '
                f'{settings!r}')
        unknown = sorted(set(settings) - set(SETTING_KEYS))
        if unknown:
            raise ValueError(f'gradient_filter: unknown key(s) {unknown}; '
                             f'allowed: {list(SETTING_KEYS)}')
        return cls(**settings)

    def as_dict(self) -> Dict[str, Any]:
        """Every setting by name (the values themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def surgery_flags(self) -> Dict[str, bool]:
        """The flags :func:`.surgery.apply_gradient_filter` takes, by name."""
        return {k: getattr(self, k) for k in SURGERY_FLAGS}


def as_settings(settings: Any) -> GradientFilterSettings:
    """``settings`` as checked :class:`GradientFilterSettings`.

    Raises:
        ValueError: as :meth:`GradientFilterSettings.from_dict`.
    """
    if isinstance(settings, GradientFilterSettings):
        return settings
    return GradientFilterSettings.from_dict(settings)


_FIELDS = {f.name: f for f in fields(GradientFilterSettings)}
#: Keys accepted in ``gradient_filter=dict(...)`` and by GradFilterHook.
SETTING_KEYS: Tuple[str, ...] = tuple(_FIELDS)
#: Every setting's default.
DEFAULTS: Dict[str, Any] = {k: f.default for k, f in _FIELDS.items()}
#: The settings that are True or False.
FLAGS: Tuple[str, ...] = tuple(k for k, f in _FIELDS.items()
                               if f.type in (bool, 'bool'))
#: The flags the surgery takes (:func:`.surgery.apply_gradient_filter`);
#: the others act on the process (:mod:`.cpu_memory`) or on the lean region
#: after it (``patch_mean_activations``: :mod:`.patch_mean_activations`).
SURGERY_FLAGS: Tuple[str, ...] = tuple(k for k, f in _FIELDS.items()
                                       if f.metadata['surgery'])




@dataclass(frozen=True)
class HookOption:
    """An argument ``GradFilterHook`` takes besides the settings."""

    default: bool
    doc: str


#: ``GradFilterHook``'s own arguments, by name.
HOOK_OPTIONS: Dict[str, HookOption] = {
    'log_table': HookOption(
        True, 'GradFilterHook: log the chosen layers\' cost table and what '
        'the step keeps for backward at train start'),
    'check_load_from': HookOption(
        True, 'GradFilterHook: before the checkpoint is loaded, fail if '
        'the load_from (or resumed) checkpoint does not exist or does not '
        'match the model (docs/reliability.md)'),
    'resume_random_state': HookOption(
        True, 'GradFilterHook: keep torch\'s random-number state in each '
        'checkpoint and put it back on resume, so that a seeded run resumes '
        'to the uninterrupted run\'s weights with dropout and random '
        'augmentations (one process; docs/reliability.md)'),
}
#: Every keyword ``GradFilterHook`` accepts: the settings, then its own.
ACCEPTED_KEYS: Tuple[str, ...] = SETTING_KEYS + tuple(HOOK_OPTIONS)


def setting_docs() -> Dict[str, Tuple[Any, str]]:
    """Every accepted key -> ``(default, doc)``, in :data:`ACCEPTED_KEYS`
    order."""
    out = {k: (f.default, f.metadata['doc']) for k, f in _FIELDS.items()}
    out.update({k: (o.default, o.doc) for k, o in HOOK_OPTIONS.items()})
    return out


def _check(out: Dict[str, Any], keys: Sequence[str]) -> None:
    """Check and normalise ``keys`` in place."""
    for key in keys:
        value, f = out[key], _FIELDS[key]
        if key in FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f'gradient_filter {key} must be True or '
                                 f'False, got {value!r}')
        elif value is not None or f.default is not None:
            out[key] = f.metadata['check'](value)


def _check_all(out: Dict[str, Any]) -> None:
    """Every rule, in the order whose first failure is reported."""
    _check(out, ('layer_kinds', ))
    if sum(out[k] is not None for k in CHOICE_KEYS) != 1:
        raise ValueError('gradient_filter: give exactly one of num_layers '
                         '(the last N convs), layers (module paths) and '
                         'budget (limits the choice must fit), got '
                         f'num_layers={out["num_layers"]!r}, '
                         f'layers={out["layers"]!r}, '
                         f'budget={out["budget"]!r}')
    late = ('mode', ) + FLAGS + ('input_size', )
    if out['budget'] is not None:
        _check_budget_settings(out, late)
    else:
        if out['radius'] is None:
            out['radius'] = DEFAULT_RADIUS
        _check(out, ('num_layers', 'layers', 'radius') + late)


def _check_budget_settings(out: Dict[str, Any], late: Sequence[str]) -> None:
    """A budget chooses layers and radii itself, for filtered convs with frozen
    norms."""
    _check(out, ('budget', ))
    if out['radius'] is not None:
        raise ValueError(
            'gradient_filter: a budget chooses the radii itself; give '
            'the candidates as budget=dict(..., radii=[2, 4, 8]) instead '
            f'of radius={out["radius"]!r}')
    _check(out, late)
    if out['mode'] != 'gf' or out['train_norm']:
        raise ValueError(
            "gradient_filter budget needs mode='gf' and "
            'train_norm=False (the costs it fits are those of filtered '
            f'convs with frozen norms), got mode={out["mode"]!r}, '
            f'train_norm={out["train_norm"]!r}')
    if out['budget']['process_mib'] is not None and out['reuse_cpu_memory']:
        raise ValueError(
            'gradient_filter budget process_mib bounds the resident memory, '
            'which reuse_cpu_memory=True lets grow to keep freed memory: '
            'give one of them')


def check_settings(settings: Any) -> Dict[str, Any]:
    """Validate gradient-filter settings before any model is built.

    Args:
        settings: a dict with keys among :data:`SETTING_KEYS` (or
            :class:`GradientFilterSettings`).

    Returns:
        dict: a new dict of every setting, the defaults filled.

    Raises:
        ValueError: not a dict, unknown key, not exactly one of
            num_layers / layers / budget, a budget with a radius, mode other
            than 'gf' or ``train_norm``, bad mode, radius, budget or
            input_size. Errors say what is allowed.
    """
    return as_settings(settings).as_dict()
