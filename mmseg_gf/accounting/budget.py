"""The ``budget`` gradient-filter setting: its limits, and the choice.

``gradient_filter=dict(budget=dict(saved_mib=..., peak_mib=...,
process_mib=..., backward_gflops=...))`` (any subset of the limits, plus
``radii``, ``batch``, ``optimizer``; docs/budget.md lists them) replaces
``num_layers`` / ``layers`` and ``radius``: a user knows a device's limits,
not which ``N`` and ``r`` fit them. Following the paper's Section 5.4
finding (c), more layers with a coarser filter beat fewer exact ones, so
the choice takes the largest ``N`` that fits at the coarsest candidate
radius, then spends what is left on finer radii, coarsest maps first."""
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..ops import check_radius
from .step_profile import ConvProfile, StepCost, StepCostProfile

__all__ = ['LIMIT_KEYS', 'PEAK_KEYS', 'BUDGET_KEYS', 'DEFAULT_RADII',
           'PEAK_HEADROOM',
           'check_budget', 'fits', 'BudgetChoice', 'choose_by_budget']

#: Limits a budget may give (any subset, at least one).
LIMIT_KEYS = ('saved_mib', 'peak_mib', 'process_mib', 'backward_gflops')
#: Limits on a predicted peak, met with :data:`PEAK_HEADROOM` to spare.
PEAK_KEYS = ('peak_mib', 'process_mib')
#: Keys of ``gradient_filter=dict(budget=dict(...))``.
BUDGET_KEYS = LIMIT_KEYS + ('radii', 'batch', 'optimizer')
#: Candidate radii when a budget names none.
DEFAULT_RADII = (2, 4, 8)
#: A setting fits a ``peak_mib`` limit when its predicted peak is at most
#: this fraction of it: predictions are within 10% of the measured peak
#: (tests/test_accounting/test_budget.py), so the measured peak stays within the
#: limit.
PEAK_HEADROOM = 0.9


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
    optimizer = out['optimizer']
    if optimizer is not None and (not isinstance(optimizer, dict)
                                  or 'type' not in optimizer):
        raise ValueError('gradient_filter budget optimizer must be an '
                         "optimizer config with a 'type', e.g. "
                         "dict(type='AdamW', lr=6e-5), got "
                         f'{optimizer!r}')
    batch = out['batch']
    if batch is not None and (isinstance(batch, bool)
                              or not isinstance(batch, int) or batch < 1):
        raise ValueError('gradient_filter budget batch must be an int >= 1, '
                         f'got {batch!r}')
    return out


def fits(cost: StepCost, limits: Dict[str, Optional[float]]) -> bool:
    """Every given limit holds; the predicted peaks with
    :data:`PEAK_HEADROOM` to spare (their tested accuracy)."""
    return all(
        limit is None or cost.value(key) <= limit *
        (PEAK_HEADROOM if key in PEAK_KEYS else 1)
        for key, limit in limits.items())


@dataclass
class BudgetChoice:
    """What :func:`choose_by_budget` chose, and why.

    Attributes:
        cost: the chosen setting's predicted cost.
        limits: the limits it had to fit.
        smallest: the cheapest setting (1 layer, coarsest radius).
    """

    cost: StepCost
    limits: Dict[str, Optional[float]]
    smallest: StepCost

    @property
    def num_layers(self) -> int:
        return self.cost.num_layers

    @property
    def radius(self) -> Dict[str, int]:
        return dict(self.cost.radii)

    def summary(self) -> str:
        given = ', '.join(f'{k} <= {v:g}' for k, v in self.limits.items()
                          if v is not None)
        radii = sorted(set(self.cost.radii.values()))
        return (f'budget ({given}): the last {self.num_layers} '
                f'{self.cost.layer_noun}, radii {radii}; predicted '
                f'{self.cost.describe()}')


def _refine_order(profile: StepCostProfile,
                  num_layers: int) -> List[ConvProfile]:
    """Coarsest maps first, then from the output backwards."""
    convs = profile.convs[profile.first_index(num_layers):]
    return sorted(convs, key=lambda c: (-c.output_stride, -c.index))


def _most_layers(profile: StepCostProfile, limits, radius: int,
                 batch: int) -> Optional[StepCost]:
    """The largest last-N setting at ``radius`` that fits, or None."""
    for n in range(profile.max_layers, 0, -1):
        cost = profile.cost(n, radius, batch)
        if fits(cost, limits):
            return cost
    return None


def choose_by_budget(profile: StepCostProfile,
                     budget: Dict[str, Any],
                     batch: int) -> BudgetChoice:
    """The most layers, then the finest radii, that fit every limit.

    Args:
        profile: from :func:`~.profile.profile_step_costs`.
        budget: checked by :func:`check_budget`.
        batch: images per step.

    Raises:
        ValueError: no setting fits; names the cheapest achievable cost.
    """
    budget = check_budget(budget)
    limits = {k: budget[k] for k in LIMIT_KEYS}
    for key in PEAK_KEYS:
        if limits[key] is not None and profile.live is None:
            raise ValueError(f'gradient_filter budget {key} needs a '
                             'profile made with timeline=True')
    if limits['process_mib'] is not None and \
            profile.process_base_bytes is None:
        raise ValueError('gradient_filter budget process_mib needs the '
                         'process\'s resident memory (Linux: '
                         '/proc/self/status) or CUDA; the profile has no '
                         'process_base_bytes')
    radii = budget['radii']
    coarsest = radii[-1]
    smallest = profile.cost(1, coarsest, batch)
    best = _most_layers(profile, limits, coarsest, batch)
    if best is None:
        given = ', '.join(f'{k} <= {v:g}' for k, v in limits.items()
                          if v is not None)
        raise ValueError(
            f'gradient_filter budget ({given}) cannot be met: the cheapest '
            f'setting, the last {smallest.layer_noun[:-1]} alone at radius '
            f'{coarsest}, needs '
            f'{smallest.describe()}; raise the limits or add a coarser '
            f'radius to budget radii (now {list(radii)})')
    current = dict(best.radii)
    order = _refine_order(profile, best.num_layers)
    for finer in reversed(radii[:-1]):
        for conv in order:
            if current[conv.path] <= finer:
                continue
            trial = dict(current, **{conv.path: finer})
            cost = profile.cost(best.num_layers, trial, batch)
            if fits(cost, limits):
                current, best = trial, cost
    return BudgetChoice(cost=best, limits=limits, smallest=smallest)
