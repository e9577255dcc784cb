"""Device discipline without a GPU: run code on tensors of a device this
machine does not have, and fail on what would break or stall there.

* :func:`fake_cuda`: torch's ``FakeTensorMode`` with tensors made on
  ``'cuda'`` (a CPU-only build runs ops on them as shapes, dtypes and
  devices): mixing in a CPU tensor raises ``FakeTensorDeviceMismatchError``
  and reading a value (``.item()``, ``bool(t)``, ``.tolist()``) raises
  ``DataDependentOutputException``; :class:`HostSyncCheck` (entered with
  it) also fails a copy to the CPU and a data-dependent shape (``nonzero``,
  boolean-mask indexing), both a host sync on CUDA. A CPU-only build
  cannot record autograd on fake CUDA tensors (autograd asks the CUDA
  runtime for the device's stream and the process aborts), so this runs
  forward code and backward formulas called as functions, under
  ``torch.no_grad``.
* The ``meta`` device runs whole training steps, autograd included: a
  tensor made on the CPU and mixed in fails, so do ``.item()`` / ``.cpu()``
  / data-dependent shapes (no data) and ops without a device-agnostic
  kernel (the compiled CPU kernels dispatch on ``device.type == 'cpu'``).
"""
import contextlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['HostSyncError', 'HostSyncCheck', 'fake_cuda']


class HostSyncError(AssertionError):
    """An op that copies to the host or waits for the device's values."""


#: Ops whose output shape depends on tensor values (a sync on CUDA).
_DATA_DEPENDENT = {'nonzero', 'masked_select', 'unique', '_unique2',
                   'unique_consecutive', 'unique_dim', 'item',
                   '_local_scalar_dense'}


class HostSyncCheck(TorchDispatchMode):
    """Fails an op that moves a non-CPU tensor to the CPU or needs its
    values on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _DATA_DEPENDENT:
            raise HostSyncError(f'{func} needs the values on the host')
        if name in ('_to_copy', 'copy_'):
            source = args[1] if name == 'copy_' else args[0]
            target = (args[0].device if name == 'copy_' else
                      kwargs.get('device') or source.device)
            if source.device.type != 'cpu' and \
                    torch.device(target).type == 'cpu':
                raise HostSyncError(f'{func} copies a {source.device} '
                                    'tensor to the CPU')
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Tensors made inside on ``device='cuda'`` are fake CUDA tensors;
    device mixing, value reads and host copies fail (see the module
    docstring). Autograd is off: a CPU-only build aborts on recording it
    for CUDA tensors."""
    mode = FakeTensorMode()
    with torch.no_grad(), mode, HostSyncCheck():
        yield mode
