"""CPU tensors taking the code paths of CUDA tensors, for counting a
step's launches without a GPU (:mod:`mmseg_gf.accounting.launches`).

In :func:`cuda_path`:

* the compiled CPU kernels are off (``MMSEG_GF_NATIVE=0``): the ops run
  their pure-PyTorch path, as CUDA tensors do (``mmseg_gf.ops.backend.extension``,
  ``bit_mask``, ``resized_loss``, ``resize`` and ``patch_grid`` ask for the
  CPU and the kernels at every call);
* the Triton path is on and runs in triton's interpreter
  (``TRITON_INTERPRET=1`` set before ``mmseg_gf`` is imported): the filtered
  conv's and Linear's ``usable`` checks accept CPU tensors there, as they
  accept CUDA ones;
* :func:`mmseg_gf.ops.backend.device_path.as_on_cuda`: the host checks only CPU
  tensors get (the resized loss's recount of non-finite logits, the
  label-range check image by image) take CUDA's side (one device-side
  assertion);
* ``F.dropout`` in training with ``0 < p < 1``, not in place, runs
  ``native_dropout``, the one fused kernel ATen picks for CUDA tensors
  (``is_fused_kernel_acceptable``); the CPU takes three;
* the optimizer's update runs its ``foreach`` ops, torch's default for
  CUDA parameters (a per-parameter loop on the CPU).
"""
import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..ops.backend import availability, switches, triton_runtime
from ..ops.backend.device_path import as_on_cuda

__all__ = ['cuda_path']


class _FusedDropout(TorchFunctionMode):
    """``F.dropout`` as CUDA tensors run it: ``native_dropout`` where ATen
    fuses it for them (training, ``0 < p < 1``, not in place, not empty)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.dropout, torch.dropout):
            x, p, train, inplace = _dropout_arguments(func, args, kwargs)
            if train and 0 < p < 1 and not inplace and x.numel() > 0:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def _dropout_arguments(func, args, kwargs):
    names = ('input', 'p', 'training' if func is F.dropout else 'train',
             'inplace')
    defaults = (None, 0.5, True, False)
    values = dict(zip(names, defaults))
    values.update(zip(names, args))
    values.update(kwargs)
    return tuple(values[n] for n in names)


@contextlib.contextmanager
def cuda_path(triton: bool = True) -> Iterator[None]:
    """CPU tensors take the code paths of CUDA tensors in the block (this
    module docstring's list), with the Triton path (``triton=True``, needs
    ``TRITON_INTERPRET=1`` before ``mmseg_gf`` was imported and triton
    installed) or without it (``False``: CUDA with ``MMSEG_GF_TRITON=0``).

    Raises:
        RuntimeError: ``triton=True`` where triton's interpreter cannot
            run the kernels on CPU tensors.
    """
    if triton and not (availability.triton_installed() and triton_runtime.INTERPRETED):
        raise RuntimeError(
            'counting the Triton path on a CPU needs triton >= '
            f'{".".join(map(str, triton_runtime.MIN_TRITON))} installed and '
            'TRITON_INTERPRET=1 in the environment before mmseg_gf is '
            'imported (found triton '
            f'{triton_runtime.triton_version()}, the interpreter '
            f'{"on" if triton_runtime.INTERPRETED else "off"}); or count without '
            'it (triton=False)')
    with availability.triton_switched(triton), \
            switches.override(MMSEG_GF_NATIVE=False), as_on_cuda(), \
            _FusedDropout():
        yield
