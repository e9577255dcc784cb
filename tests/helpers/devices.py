"""Where the device-parametrized tests run: the CPU always, CUDA where a GPU
is present.

Three execution paths compute every lean / filtered result, and the tests
that take ``device_path`` run each of them:

* ``'cpu'``: CPU tensors with the compiled kernels (``csrc/``) where they
  are built;
* ``'cpu-kernels-off'``: CPU tensors with ``MMSEG_GF_NATIVE=0``, i.e. the
  device-agnostic PyTorch path that CUDA tensors take (the compiled
  kernels serve CPU tensors only);
* ``'cuda'``: CUDA tensors (that same path, or the Triton kernels for the
  filtered conv), skipped without a GPU and marked ``cuda``, so that
  ``pytest -m cuda`` (what ``make gpu-check`` runs) selects exactly the
  CUDA variants.

Tests whose kernels-off variant is covered elsewhere take ``device``
(``'cpu'`` / ``'cuda'``) instead, so that the CPU suite does not run the
same path twice.
"""
import contextlib
from typing import Iterator

import pytest
import torch

from mmseg_gf.models.layer_kinds import kind_names
from mmseg_gf.ops.backend import switches

__all__ = ['CUDA_AVAILABLE', 'needs_cuda', 'needs_token_kinds', 'DEVICES',
           'DEVICE_PATHS', 'kernels_off', 'on_path']

CUDA_AVAILABLE = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA_AVAILABLE,
                                reason='no CUDA GPU on this machine')
#: The Linear and attention kinds (and so their frozen lean variants) are
#: registered with their token-grid rules, which import mmseg's blocks
#: (``mmseg_gf/models/__init__.py``): where mmseg is not installed (the
#: aarch64 op check) a frozen Linear stays plain.
needs_token_kinds = pytest.mark.skipif(
    'linear' not in kind_names(),
    reason='the Linear / attention kinds are registered with mmseg')
_CUDA = pytest.param('cuda', marks=[pytest.mark.cuda, needs_cuda],
                     id='cuda')

#: ``@pytest.mark.parametrize('device', DEVICES)``
DEVICES = ['cpu', _CUDA]
#: ``@pytest.mark.parametrize('device_path', DEVICE_PATHS)``; the test runs
#: its body under ``with on_path(device_path) as device:``.
DEVICE_PATHS = ['cpu', 'cpu-kernels-off', _CUDA]


@contextlib.contextmanager
def kernels_off() -> Iterator[None]:
    """The compiled CPU kernels switched off (``MMSEG_GF_NATIVE`` off
    through :func:`mmseg_gf.ops.backend.switches.override`) inside the block; the
    previous setting restored."""
    with switches.override(MMSEG_GF_NATIVE=False):
        yield


@contextlib.contextmanager
def on_path(device_path: str) -> Iterator[str]:
    """Run the block on one of :data:`DEVICE_PATHS`; yields the device."""
    if device_path == 'cpu-kernels-off':
        with kernels_off():
            yield 'cpu'
    else:
        yield device_path
