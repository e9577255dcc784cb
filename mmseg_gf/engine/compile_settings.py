"""``torch.compile`` settings for a gradient-filtered model on CPU and CUDA.

A config's ``compile`` setting is ``True`` or a dict of ``torch.compile``
keyword arguments (mmengine's; ``GradFilterHook`` compiles the segmentor's
loss with it: :mod:`.compiled_loss`). On CPU, Inductor, by
default, lays out the convolutions of a CNN graph channels-last (its
``layout_optimization``), weights included, and converts where a tensor
meets an operator that wants another layout. A gradient-filtered step's
CPU operators (patch sums, bit masks, the filtered backward, the resized
loss: docs/lean_region.md#torchcompile) read contiguous NCHW tensors, and
oneDNN's channels-last convolutions ran slower than its NCHW ones on the
frozen layers measured here. With the layout optimization off, the compiled
lean step of Swin-T UPerNet (last 20 layers, 256x256, batch 2, 2-core AMD
EPYC Zen 4) took 0.85x eager mode's time, against 1.002-1.007x with it on;
PSPNet-R18, BiSeNetV2 and Segformer-B0 0.94, 0.94 and 0.82x
(docs/benchmarks/steps_compiled_cpu_256_b2.md).

So for a model with the lean trained region on CPU, a ``compile``
setting for Inductor (the default backend) that names neither ``mode`` nor
``options`` (``torch.compile`` accepts one of the two) gets
``options=dict(layout_optimization=False)``; one that names either, or
another backend, is kept as it is:
``compile=dict(options=dict(layout_optimization=True))`` keeps Inductor's
default. Only lean models: without the lean region's resize operator,
Inductor's C++ backend with the layout optimization off fails to generate
the scatter of a decomposed bilinear backward into a 1x1 pyramid branch
(UPerNet's, trained plainly: an ``InductorError`` in its first step).

On CUDA a lean model compiles in ``mode='reduce-overhead'`` unless the
setting names a mode, options or another backend: a lean step's kernels
are short and few (the frozen layers' forward, a filtered backward on
patch sums), so the host's Python and launch time bounds it (on an H200 at
512x512, batch 8, the GPU was busy 18-58% of an eager lean step:
docs/benchmarks/gpu_h200_step_time_512_b8.md). CUDA graphs replay the
compiled loss's kernels, forward and backward, without the host. They
need what the lean step gives: no host sync, the same operators and
shapes every step (the loss compiles with ``dynamic=False``), one graph
with no mutated input besides parameters and buffers. Where Inductor
finds otherwise it logs ``skipping cudagraphs due to ...`` and runs the
compiled code as in the default mode. Inductor's options stay its own
(``torch.compile`` takes a mode or options, not both): the convolutions'
channels-last layout suits CUDA's kernels and the Triton path, which read
their tensors by strides. Other devices keep the setting.
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
    """``setting`` (mmengine's ``compile``: None / False off, True or a dict
    of ``torch.compile`` keyword arguments on) as a gradient-filtered model
    compiles on ``device_type``, for a ``lean`` model where the setting
    names no ``options`` and no backend other than Inductor:

    * on ``'cpu'``, with :data:`CPU_INDUCTOR_OPTIONS` added, unless it
      names a ``mode`` other than ``'default'`` (``mode='default'`` is
      dropped: ``torch.compile`` takes a mode or options, not both);
    * on ``'cuda'``, in :data:`CUDA_MODE` unless it names a ``mode``;

    otherwise unchanged (the same object; a new dict where it changes).

    Raises:
        TypeError: ``setting`` is none of None, a bool or a dict (the
            types mmengine takes).
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
