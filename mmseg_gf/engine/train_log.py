"""What the training log states besides mmengine's fields: the precision
and, on CPU, the peak resident memory per log interval (``peak_rss``,
docs/usage.md).
"""
import os
from typing import Optional

from mmengine.hooks import LoggerHook

__all__ = ['precision_summary', 'PeakResidentMemory', 'logged_now',
           'peak_resident_bytes', 'resident_bytes']

#: The log line's key of :class:`PeakResidentMemory`'s peak (MiB).
PEAK_KEY = 'peak_rss'


def precision_summary(optim_wrapper) -> str:
    """One line naming the training precision."""
    wrappers = getattr(optim_wrapper, 'optim_wrappers', None)
    items = list(wrappers.values()) if isinstance(wrappers, dict) else [
        optim_wrapper]
    parts = []
    for wrapper in items:
        name = type(wrapper).__name__
        if 'Amp' not in name:
            parts.append(f'AMP off (parameters\' dtype, {name})')
            continue
        dtype = getattr(wrapper, 'cast_dtype', None)
        device = 'cpu' if name.startswith('CPU') else 'cuda'
        dtype = str(dtype).replace('torch.', '') if dtype is not None else (
            'float16')
        parts.append(f'AMP on: {device} autocast to {dtype} ({name})')
    return 'training precision: ' + '; '.join(dict.fromkeys(parts))


def _status_bytes(key: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_resident_bytes() -> Optional[int]:
    """The process's highest resident memory so far (``VmHWM``), or None."""
    return _status_bytes('VmHWM')


def resident_bytes() -> Optional[int]:
    """The process's resident memory now (``VmRSS``), or None."""
    return _status_bytes('VmRSS')


class PeakResidentMemory:
    """Peak resident memory since the last :meth:`reset` (process-wide
    reset)."""

    def __init__(self) -> None:
        self.supported = peak_resident_bytes() is not None and os.access(
            '/proc/self/clear_refs', os.W_OK)

    def reset(self) -> bool:
        """Start a new interval; False where the peak cannot be reset."""
        if not self.supported:
            return False
        try:
            with open('/proc/self/clear_refs', 'w') as f:
                f.write('5')
        except OSError:
            self.supported = False
        return self.supported

    def peak_mib(self) -> Optional[float]:
        """The peak since the last reset, MiB (None where unsupported)."""
        peak = peak_resident_bytes() if self.supported else None
        return None if peak is None else round(peak / 2**20, 1)


def logged_now(runner, batch_idx: int) -> bool:
    """Whether the ``LoggerHook`` writes a log line after this iteration."""
    for hook in runner.hooks:
        if not isinstance(hook, LoggerHook):
            continue
        if hook.every_n_inner_iters(batch_idx, hook.interval):
            return True
        loader = runner.train_dataloader
        return bool(hook.end_of_epoch(loader, batch_idx) and (
            not hook.ignore_last or len(loader) <= hook.interval))
    return False
