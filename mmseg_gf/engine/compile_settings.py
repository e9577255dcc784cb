"""``torch.compile`` settings for a gradient-filtered model on CPU and CUDA.

A config's ``compile`` (``True`` or ``torch.compile`` keyword arguments) is
applied by ``GradFilterHook`` to the segmentor's loss (:mod:`.compiled_loss`).
For a lean model whose setting names neither ``mode`` nor ``options`` nor
another backend:

* on CPU it gets ``options=dict(layout_optimization=False)``: the lean
  operators read NCHW tensors, and Inductor's channels-last layout made the
  compiled step slower (docs/lean_region.md, section on ``torch.compile``;
  docs/benchmarks/steps_compiled_cpu_256_b2.md). Only lean models: without
  the lean resize, Inductor's C++ backend with the layout optimization off
  fails on the decomposed bilinear backward into a 1x1 pyramid branch
  (UPerNet, an ``InductorError`` in the first step);
* on CUDA it compiles in ``mode='reduce-overhead'``: a lean step's few short
  kernels leave it host-bound (docs/benchmarks/gpu_h200_step_time_512_b8.md),
  and CUDA graphs replay them without the host (no sync, fixed shapes with
  ``dynamic=False``, no mutated inputs; otherwise Inductor logs ``skipping
  cudagraphs`` and runs the default mode).

A setting naming any of them is kept as it is; other devices keep it too.
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
    """``setting`` (mmengine's ``compile``) as a gradient-filtered model compiles
    on ``device_type``: for a ``lean`` model on Inductor without ``options``,
    on CPU with :data:`CPU_INDUCTOR_OPTIONS` unless a non-default ``mode`` is
    named (``mode='default'`` is dropped), on CUDA in :data:`CUDA_MODE` unless
    a mode is named; otherwise the same object.

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
    """:func:`compile_setting` for ``model`` (wrapped or not): on its
    parameters' device (CPU without any), lean as its gradient-filter
    state says, else as ``lean`` says (a model not prepared yet; None: not
    lean)."""
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
