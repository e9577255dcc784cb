"""What the benchmarks ran on, for their tables: every published timing
names its CPU; and the process's resident memory."""
import os
import platform
from typing import Optional

from ..engine.train_log import peak_resident_bytes

__all__ = ['cpu_model', 'resident_bytes', 'vm_rss_bytes',
           'peak_resident_bytes']


def cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resident_bytes() -> Optional[int]:
    """The process's resident memory now (Linux ``/proc/self/statm``;
    None elsewhere)."""
    try:
        with open('/proc/self/statm') as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf('SC_PAGE_SIZE')


def vm_rss_bytes() -> Optional[int]:
    """The process's resident memory now as ``/proc/self/status`` states
    it (``VmRSS``, Linux; None elsewhere)."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmRSS:'):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None
