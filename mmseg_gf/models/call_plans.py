"""What a filtered layer decides once per call signature, kept on the
module.

A training step calls each layer with the same shapes at every iteration:
which implementation runs, its arguments and the patches its output is
tagged with are decided at the first call of a signature (the input's and
parameters' metadata, the layer's settings, the backend switches) and
looked up afterwards. A change of any part of the key decides again; a
module keeps a few signatures, the least recently used dropped first.
Under ``torch.compile`` the layers decide per call, as Dynamo traces them.
"""
from collections import OrderedDict
from typing import Any, Callable, Hashable

from ..patching import PRIVATE_PREFIX

__all__ = ['PLAIN', 'CACHE_SIZE', 'plan_for', 'kept_plans', 'plans_made']

#: The plan of a call that does not filter: the plain layer runs.
PLAIN = 'plain'
#: Call signatures a module keeps a plan for, per name.
CACHE_SIZE = 8

_made = [0]  # plans decided in this process (plans_made)


def plan_for(module, name: str, key: Hashable,
             decide: Callable[..., Any], *args) -> Any:
    """``decide(*args)`` for ``key``, made at the first call and kept on
    ``module`` (attribute ``_gf_<name>``)."""
    attribute = PRIVATE_PREFIX + name
    plans = module.__dict__.get(attribute)
    if plans is None:
        plans = module.__dict__[attribute] = OrderedDict()
    if key in plans:
        return plans[key]
    plan = plans[key] = decide(*args)
    _made[0] += 1
    if len(plans) > CACHE_SIZE:
        plans.popitem(last=False)
    return plan


def kept_plans(module, name: str) -> 'OrderedDict[Hashable, Any]':
    """The plans ``module`` keeps under ``name`` (empty if none)."""
    return module.__dict__.get(PRIVATE_PREFIX + name, OrderedDict())


def plans_made() -> int:
    """Plans decided in this process so far: a steady training step makes
    none (:mod:`mmseg_gf.analysis.host_time` reports it)."""
    return _made[0]
