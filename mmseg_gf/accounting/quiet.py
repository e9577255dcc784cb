"""torch's profiler messages left out of the process's stderr.

Each time torch's profiler starts and stops (the peak measurements of
:mod:`.measured` run it once per step), kineto writes ``profiler_start`` /
``profiler_stop`` lines, and c10 may add a note on memory allocated before
profiling, from C++ straight to file descriptor 2: Python's ``sys.stderr``
and ``warnings`` filters never see them, and a tool measuring a dozen
models printed over a hundred of them. :func:`quiet_profiler` routes file
descriptor 2 through a filter for a block and passes every other line on
as it comes (warnings and errors still show).
"""
import contextlib
import os
import re
import sys
import threading
from typing import Iterator

__all__ = ['PROFILER_NOISE', 'quiet_profiler']

#: The lines :func:`quiet_profiler` drops.
PROFILER_NOISE = re.compile(
    rb'ActivityProfiler[A-Za-z]*\.cpp:\d+\] (profiler_st(art|op)|'
    rb'Completed Stage)|CPUAllocator\.cpp:\d+\] Memory block of unknown '
    rb'size was allocated before the profiling started')


def _forward(read_fd: int, out_fd: int) -> None:
    """Copy lines from ``read_fd`` to ``out_fd`` until EOF, but the noise."""
    with os.fdopen(read_fd, 'rb') as pipe:
        for line in pipe:
            if not PROFILER_NOISE.search(line):
                os.write(out_fd, line)


@contextlib.contextmanager
def quiet_profiler(enabled: bool = True) -> Iterator[None]:
    """Within the block, lines on file descriptor 2 matching
    :data:`PROFILER_NOISE` are dropped, the rest written on, line by line,
    to what descriptor 2 was before. ``enabled=False``: nothing changes.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    thread = threading.Thread(target=_forward, args=(read_fd, saved),
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's write end: the copy ends
        thread.join()
        os.close(saved)
