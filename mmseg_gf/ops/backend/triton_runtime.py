"""The Triton runtime every GPU path shares: whether triton is installed
and switched on, which devices may take a Triton path, and the helpers
around a launch (the current CUDA device, autocast off, fake tensors).

Decided once, at import: dispatch must not import modules or read triton's
settings while ``torch.compile`` traces it. Without triton
(:data:`MIN_TRITON` or newer) installed, with ``MMSEG_GF_TRITON=0`` in the
environment or after :func:`set_enabled(False) <set_enabled>`, every path
falls back to PyTorch. CPU tensors take a Triton path only under triton's
interpreter (``TRITON_INTERPRET=1`` set before ``mmseg_gf`` is imported),
which is how the kernels are tested on machines without a GPU.

This module imports no triton: the kernels' modules do, loaded on first
use by each operator's ``gpu`` module.
"""
import contextlib
import importlib.metadata
import importlib.util
import re
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import switches

__all__ = [
    'MIN_TRITON', 'INTERPRETED', 'FLOAT_TYPES', 'triton_version',
    'installed', 'enabled', 'set_enabled', 'takes_device', 'on_device',
    'no_autocast', 'is_fake', 'call'
]

#: The oldest triton the kernels were tested with (the interpreter cases
#: and an sm_90 compilation: 3.2 through 3.9, requirements/tests.txt); an
#: older one leaves the path off.
MIN_TRITON = (3, 2)

#: The float dtypes a Triton path takes.
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def triton_version() -> Optional[Tuple[int, ...]]:
    """The installed triton's ``(major, minor, patch)`` from its package
    metadata (without importing it), None if it is not installed."""
    if importlib.util.find_spec('triton') is None:
        return None
    try:
        text = importlib.metadata.version('triton')
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(v) for v in re.findall(r'\d+', text)[:3])


_VERSION = triton_version()
_INSTALLED = _VERSION is not None and _VERSION >= MIN_TRITON

#: Whether the kernels run in triton's interpreter (``TRITON_INTERPRET``,
#: read at import): CPU tensors take the Triton paths then.
INTERPRETED = bool(switches.value('TRITON_INTERPRET'))


def installed() -> bool:
    """True if triton (:data:`MIN_TRITON` or newer) is installed."""
    return _INSTALLED


def enabled() -> bool:
    """True if triton is installed and the GPU path is switched on
    (``MMSEG_GF_TRITON`` not ``0``, or :func:`set_enabled(True)`)."""
    return _INSTALLED and switches.value('MMSEG_GF_TRITON')


def set_enabled(flag: Optional[bool]) -> Optional[bool]:
    """Switch the Triton paths on (``True``) or off (``False``) for this
    process, whatever ``MMSEG_GF_TRITON`` says; ``None`` goes back to the
    env var. Returns the previous override."""
    return switches.set_value('MMSEG_GF_TRITON',
                              None if flag is None else bool(flag))


def device_refusal(t: Tensor) -> Optional[str]:
    """Why a tensor on ``t``'s device may not take a Triton path, or None:
    triton installed and switched on, ``t`` on CUDA (on CPU only under the
    interpreter). Each path adds its own conditions."""
    if not _INSTALLED:
        return 'triton not installed' if _VERSION is None else (
            f'triton {_VERSION} older than {MIN_TRITON}')
    device = t.device.type
    if not (device == 'cuda' or (INTERPRETED and device == 'cpu')):
        return f'{device} tensor'
    if not switches.value('MMSEG_GF_TRITON'):
        return 'MMSEG_GF_TRITON off'
    return None


def takes_device(t: Tensor) -> bool:
    """Whether a tensor on ``t``'s device may take a Triton path at all
    (:func:`device_refusal` gives no reason)."""
    return device_refusal(t) is None


def on_device(t: Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def no_autocast(t: Tensor):
    """Products that run in the accumulation dtype, never autocast's."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def is_fake(t: Tensor) -> bool:
    """A ``FakeTensor`` (checked without importing its module for the plain
    tensors of eager training)."""
    if type(t) is Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake as fake
    return fake(t)


def call(op, impl, *args):
    """Under ``torch.compile`` and on fake tensors (``FakeTensorMode``:
    shape propagation, the suite's device checks) the registered op, whose
    fake implementation runs; in eager mode the implementation itself,
    without the dispatcher's round trip back into Python."""
    if torch.compiler.is_compiling() or is_fake(args[0]):
        return op(*args)
    return impl(*args)
