"""The Triton runtime every GPU path shares: the installed triton's
version, whether its interpreter runs the kernels, and launch helpers
(whether a path may take triton: :mod:`.availability`).

Decided at import, since dispatch must not import modules while
``torch.compile`` traces. CPU tensors take a Triton path only under
triton's interpreter (``TRITON_INTERPRET=1`` before import: the tests).
Imports no triton.
"""
import contextlib
import importlib.metadata
import importlib.util
import re
from types import ModuleType
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import switches

__all__ = [
    'MIN_TRITON', 'INTERPRETED', 'FLOAT_TYPES', 'TRITON_VERSION',
    'triton_version', 'lazy_module', 'on_device', 'no_autocast', 'is_fake',
    'call'
]

#: The oldest triton the kernels were tested with (the interpreter cases
#: and an sm_90 compilation: 3.2 through 3.9, requirements/tests.txt); an
#: older one leaves the path off.
MIN_TRITON = (3, 2)

#: The float dtypes a Triton path takes.
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def triton_version() -> Optional[Tuple[int, ...]]:
    """The installed triton's version from its metadata, or None."""
    if importlib.util.find_spec('triton') is None:
        return None
    try:
        text = importlib.metadata.version('triton')
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(v) for v in re.findall(r'\d+', text)[:3])


#: The installed triton's version (read at import), or None.
TRITON_VERSION = triton_version()

#: Whether the kernels run in triton's interpreter (``TRITON_INTERPRET``,
#: read at import): CPU tensors take the Triton paths then.
INTERPRETED = bool(switches.value('TRITON_INTERPRET'))


def lazy_module(load: Callable[[], ModuleType]) -> Callable[[], ModuleType]:
    """A function giving the module ``load()`` imports, loaded at its first
    call: a path's kernels import triton only when first used, and a later
    call is a list lookup, not an import statement (about 1 us each,
    several per layer call)."""
    held = []

    def module() -> ModuleType:
        if not held:
            held.append(load())
        return held[0]

    return module


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
    """A ``FakeTensor`` (checked without importing its module)."""
    if type(t) is Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake as fake
    return fake(t)


def call(op, impl, *args):
    """The registered op under ``torch.compile`` and on fake tensors, else the
    implementation itself (no dispatcher round trip).
    """
    if torch.compiler.is_compiling() or is_fake(args[0]):
        return op(*args)
    return impl(*args)
