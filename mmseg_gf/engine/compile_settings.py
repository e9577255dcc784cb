"""``torch.compile`` settings for a gradient-filtered model on CPU and CUDA.

A lean model whose setting names no ``mode``, ``options`` or backend
compiles on CPU with Inductor's layout optimization off, on CUDA with
``mode='reduce-overhead'``; why, and when each fails:
docs/reliability.md#torchcompile-channels_last.
"""
from typing import Any, Optional, Union

from torch import nn

from .state import get_state

__all__ = ['CPU_INDUCTOR_OPTIONS', 'CUDA_MODE', 'compile_setting',
           'model_compile_setting', 'describe']

#: The Inductor options a gradient-filtered model compiles with on CPU.
CPU_INDUCTOR_OPTIONS = {'layout_optimization': False}
#: The ``torch.compile`` mode a gradient-filtered model compiles in on CUDA.
CUDA_MODE = 'reduce-overhead'

CompileSetting = Union[None, bool, dict]


def compile_setting(setting: CompileSetting, device_type: str,
                    lean: bool) -> CompileSetting:
    """``setting`` (mmengine's ``compile``) as a lean model compiles on
    ``device_type``.

    Raises:
        TypeError: ``setting`` is not None, a bool or a dict.
    """
    if setting is not None and not isinstance(setting, (bool, dict)):
        raise TypeError('compile must be None, a bool or a dict of '
                        'torch.compile arguments, got '
                        f'{type(setting).__name__}')
    if setting is None or setting is False or not lean or \
            device_type not in ('cpu', 'cuda'):
        return setting  # off (an empty dict is on: torch's defaults)
    kwargs: dict = {} if setting is True else dict(setting)
    if 'options' in kwargs or \
            kwargs.get('backend', 'inductor') != 'inductor':
        return setting
    mode = kwargs.get('mode')
    if device_type == 'cuda':
        if mode is not None:
            return setting
        kwargs['mode'] = CUDA_MODE
        return kwargs
    if mode not in (None, 'default'):
        return setting
    if mode == 'default':
        del kwargs['mode']
    kwargs['options'] = dict(CPU_INDUCTOR_OPTIONS)
    return kwargs


def model_compile_setting(setting: CompileSetting, model: nn.Module,
                          lean: Optional[bool] = None) -> CompileSetting:
    """:func:`compile_setting` on ``model``'s device, lean as its state (or
    ``lean``) says."""
    params = next(model.parameters(), None)
    state = get_state(model)
    return compile_setting(
        setting, 'cpu' if params is None else params.device.type,
        state.lean if state is not None else bool(lean))


def describe(setting: Any) -> str:
    """A log line for a setting :func:`compile_setting` changed."""
    if 'options' in setting:
        what = f'on CPU with Inductor options {setting["options"]}'
        keep = 'compile=dict(options=...) or a mode keeps yours'
    else:
        what = f'on CUDA in mode={setting["mode"]!r} (CUDA graphs)'
        keep = "compile=dict(mode='default') or options keep yours"
    return (f'torch.compile {what} (mmseg_gf.engine.compile_settings says '
            f'why; {keep})')
