"""The ``budget`` gradient-filter setting: limits the choice must fit.

``gradient_filter=dict(budget=dict(saved_mib=300, peak_mib=..., backward_gflops=1))``
(any subset of the limits; ``radii``: the candidate radii, default
{2, 4, 8}; ``batch``: images per step, default the config's train batch
size) replaces ``num_layers`` / ``layers`` and ``radius``:
:func:`mmseg_gf.analysis.step_profile.choose_by_budget` picks the largest
number of last convs, then the finest radii, whose predicted step cost fits
every limit. This module only validates the setting, so that bad input fails
before anything is built.
"""
import math
from typing import Any, Dict

from ..ops import check_radius

__all__ = ['LIMIT_KEYS', 'BUDGET_KEYS', 'DEFAULT_RADII', 'check_budget']

#: Limits a budget may give (any subset, at least one).
LIMIT_KEYS = ('saved_mib', 'peak_mib', 'backward_gflops')
#: Keys of ``gradient_filter=dict(budget=dict(...))``.
BUDGET_KEYS = LIMIT_KEYS + ('radii', 'batch')
#: Candidate radii when a budget names none.
DEFAULT_RADII = (2, 4, 8)


def check_budget(budget: Any) -> Dict[str, Any]:
    """Validate a budget before anything is built.

    Returns:
        dict: the limits given, ``radii`` (sorted, unique) and ``batch``
        (None when not given: the config's training batch is used).

    Raises:
        ValueError: not a dict, unknown key, no limit, a limit that is not a
            positive number, bad radii or batch; the message lists what is
            allowed.
    """
    if not isinstance(budget, dict):
        raise ValueError(
            'gradient_filter budget must be a dict, e.g. dict(saved_mib=300)'
            f', with keys among {list(BUDGET_KEYS)}; got {budget!r}')
    unknown = sorted(set(budget) - set(BUDGET_KEYS))
    if unknown:
        raise ValueError(f'gradient_filter budget: unknown key(s) {unknown}'
                         f'; allowed: {list(BUDGET_KEYS)}')
    out: Dict[str, Any] = {k: None for k in BUDGET_KEYS}
    out.update(budget)
    if all(out[k] is None for k in LIMIT_KEYS):
        raise ValueError('gradient_filter budget needs at least one limit '
                         f'among {list(LIMIT_KEYS)}, got {budget!r}')
    for key in LIMIT_KEYS:
        value = out[key]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(
                value, (int, float)) or not value > 0 or math.isinf(value):
            raise ValueError(f'gradient_filter budget {key} must be a '
                             f'positive number, got {value!r}')
    radii = DEFAULT_RADII if out['radii'] is None else out['radii']
    if isinstance(radii, int):
        radii = (radii, )
    try:
        radii = tuple(sorted({check_radius(r) for r in radii}))
    except (TypeError, ValueError):
        raise ValueError('gradient_filter budget radii must be a non-empty '
                         f'list of ints >= 1, got {out["radii"]!r}') from None
    if not radii:
        raise ValueError('gradient_filter budget radii must be a non-empty '
                         f'list of ints >= 1, got {out["radii"]!r}')
    out['radii'] = radii
    batch = out['batch']
    if batch is not None and (isinstance(batch, bool)
                              or not isinstance(batch, int) or batch < 1):
        raise ValueError('gradient_filter budget batch must be an int >= 1, '
                         f'got {batch!r}')
    return out
