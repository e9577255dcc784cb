"""The process-wide settings that change what a test computes, read and
restored, and the global random generators, reseeded.

pytest-xdist (``make test``) runs many test files one after the other in
each worker process, in an order that depends on timing. A setting one test
leaves changed (threads, default dtype, a switch of
:mod:`mmseg_gf.ops.backend.switches`, a compiled kernel's toggle, a backend flag)
or the state a test leaves torch's global generator in then reaches the
tests that happen to run after it in that worker. tests/conftest.py starts
every test from the same seeds and fails a test, or a file, whose end state
differs from its start (after restoring it, so that the tests after it are
not affected too).

Left out on purpose: the compiled kernels' output pool and malloc's
thresholds (``process_mib`` and ``reuse_cpu_memory`` budgets set them for
the process by design; they move memory, not numbers), and
``torch.get_num_interop_threads`` (settable once per process).
"""
import random
from typing import Any, Callable, Dict, List, NamedTuple

import numpy
import torch

from mmseg_gf.ops.backend import (cpu_settings, device_path, extension,
                                  switches, triton_runtime)

__all__ = ['SEED', 'seed_global_generators', 'snapshot', 'restore',
           'changes']

#: The seed of torch's, numpy's and Python's global generators at the start
#: of every test.
SEED = 0


def seed_global_generators(seed: int = SEED) -> None:
    """Reseed the generators a test draws from without a generator of its
    own (e.g. ``torch.nn.Conv2d``'s initialisation): the draws then do not
    depend on what ran before in the process."""
    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)


class _Setting(NamedTuple):
    read: Callable[[], Any]
    write: Callable[[Any], None]


def _flush_denormal() -> bool:
    """torch has no getter for :func:`torch.set_flush_denormal`: with it on,
    a subnormal float32 reads as zero."""
    return bool(torch.tensor(1e-40, dtype=torch.float32) * 1.0 == 0)


def _deterministic() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


def _set_deterministic(value: tuple) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _attribute(owner: Any, name: str) -> _Setting:
    return _Setting(lambda: getattr(owner, name),
                    lambda value: setattr(owner, name, value))


def _autocast(device: str) -> _Setting:
    return _Setting(lambda: torch.is_autocast_enabled(device),
                    lambda value: torch.set_autocast_enabled(device, value))


def _switches(held: Dict[str, Any]) -> _Setting:
    """One of :mod:`~mmseg_gf.ops.backend.switches`' tables: what it read from the
    environment (or an :func:`~mmseg_gf.ops.backend.switches.override` put there),
    or what was set at run time (``set_value``,
    ``availability.set_triton_enabled``, ``set_load_limit``)."""

    def write(saved: Dict[str, Any]) -> None:
        held.clear()
        held.update(saved)

    return _Setting(lambda: dict(held), write)


def _toggle(setter: Callable[[bool], bool]) -> _Setting:
    """A compiled kernel's toggle: its binding has a setter that returns
    the previous value and no getter of the setting itself
    (``token_rows_avx512_enabled`` also says whether the CPU has AVX-512)."""

    def read() -> bool:
        previous = setter(True)
        setter(previous)
        return previous

    return _Setting(read, setter)


def _set_as_on_cuda(value: bool) -> None:
    device_path._as_cuda = value


def _settings() -> Dict[str, _Setting]:
    backends = torch.backends
    settings = {
        'torch.get_num_threads': _Setting(torch.get_num_threads,
                                          torch.set_num_threads),
        'torch.get_default_dtype': _Setting(torch.get_default_dtype,
                                            torch.set_default_dtype),
        'torch.get_default_device': _Setting(torch.get_default_device,
                                             torch.set_default_device),
        'torch.is_grad_enabled': _Setting(torch.is_grad_enabled,
                                          torch.set_grad_enabled),
        'torch.is_anomaly_enabled': _Setting(torch.is_anomaly_enabled,
                                             torch.set_anomaly_enabled),
        'deterministic algorithms (enabled, warn_only)': _Setting(
            _deterministic, _set_deterministic),
        'torch.get_float32_matmul_precision': _Setting(
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision),
        'flush denormal': _Setting(_flush_denormal, torch.set_flush_denormal),
        'autocast on cpu': _autocast('cpu'),
        'autocast on cuda': _autocast('cuda'),
        'torch.backends.mkldnn.enabled': _attribute(backends.mkldnn,
                                                    'enabled'),
        'switches read from the environment': _switches(
            switches._environment),
        'switches set at run time': _switches(switches._runtime),
        'device_path.acting_as_cuda': _Setting(device_path.acting_as_cuda,
                                               _set_as_on_cuda),
    }
    for name in ('enabled', 'benchmark', 'deterministic', 'allow_tf32'):
        settings[f'torch.backends.cudnn.{name}'] = _attribute(
            backends.cudnn, name)
    for name in ('allow_tf32', 'allow_fp16_reduced_precision_reduction',
                 'allow_bf16_reduced_precision_reduction'):
        settings[f'torch.backends.cuda.matmul.{name}'] = _attribute(
            backends.cuda.matmul, name)
    if extension.built():
        for setter in (cpu_settings.set_onednn_products,
                       cpu_settings.set_token_rows_avx512):
            settings[f'native.{setter.__name__}'] = _toggle(setter)
    return settings


_SETTINGS = _settings()
_UNSET = object()


def snapshot() -> Dict[str, Any]:
    """Every setting's value now."""
    return {name: s.read() for name, s in _SETTINGS.items()}


def restore(saved: Dict[str, Any]) -> None:
    """Set back every setting that differs from ``saved``."""
    now = snapshot()
    for name, value in saved.items():
        if now[name] != value:
            _SETTINGS[name].write(value)


def _difference(before: Any, after: Any) -> str:
    """``before -> after``; for a table, of the entries that differ."""
    if not isinstance(before, dict):
        return f'{before!r} -> {after!r}'
    return ', '.join(
        f'{key} {before.get(key, "unset")!r} -> {after.get(key, "unset")!r}'
        for key in sorted(set(before) | set(after))
        if before.get(key, _UNSET) != after.get(key, _UNSET))


#: Settings the product changes for the process by design, restored after
#: each test without failing it: an mmengine Runner turns cuDNN's benchmark
#: mode on when its config's ``env_cfg`` says so (mmseg's default runtime
#: does), and every test that trains through a Runner builds one.
QUIETLY_RESTORED = ('torch.backends.cudnn.benchmark', )


def changes(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    """``name: before -> after`` for each setting that differs (but those
    :data:`QUIETLY_RESTORED`)."""
    return [f'{name}: {_difference(before[name], after[name])}'
            for name in before if after[name] != before[name]
            and name not in QUIETLY_RESTORED]
