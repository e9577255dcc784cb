"""The optimizer's state per trained parameter, measured.

Between two steps an optimizer holds state for every parameter it updates:
SGD with momentum one buffer, Adam / AdamW two moments (AMSGrad a third),
each the parameter's size. For a memory budget those bytes are as real as
the activations, and they grow with the trained parameters, so a setting
training more layers holds more. Rather than a table of optimizers,
:func:`optimizer_state_ratio` builds the config's optimizer on one small
parameter, takes two steps and counts the bytes of the tensors in its
state: any registered optimizer is measured the same way.
"""
from typing import Optional

import torch
from mmseg.registry import OPTIMIZERS

__all__ = ['optimizer_state_ratio', 'STATE_PROBE_NUMEL']

#: Elements of the parameter the optimizer is measured on (its per-tensor
#: scalars, e.g. Adam's ``step``, are then a negligible share).
STATE_PROBE_NUMEL = 1 << 16


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                key = value.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total


def optimizer_state_ratio(optimizer: Optional[dict]) -> float:
    """Bytes of state per byte of trained parameter of the optimizer
    config ``optimizer`` (as in ``optim_wrapper.optimizer``: ``type`` and
    its arguments); 0.0 for None.

    Raises:
        ValueError: not a dict with a ``type``, or it cannot be built.
    """
    if optimizer is None:
        return 0.0
    if not isinstance(optimizer, dict) or 'type' not in optimizer:
        raise ValueError('gradient_filter budget optimizer must be an '
                         "optimizer config with a 'type' (the config's "
                         f'optim_wrapper.optimizer), got {optimizer!r}')
    param = torch.nn.Parameter(torch.zeros(STATE_PROBE_NUMEL))
    try:
        built = OPTIMIZERS.build(dict(optimizer, params=[param]))
    except Exception as err:  # noqa: BLE001 - the registry's own errors
        raise ValueError(f'gradient_filter budget optimizer {optimizer!r} '
                         f'cannot be built: {err}') from err
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        param.grad = torch.randn(param.shape, generator=generator)
        built.step()
    return _state_bytes(built) / (param.numel() * param.element_size())
