"""The parent's side of one fault-injection child
(:mod:`.fault_injection`): start it, kill it at the planned moment, read
what it reached.

The child appends ``start <iter>`` and ``iter <n>`` lines to a progress
file (a file, not a pipe or a queue: a child killed in the middle of a
message leaves at most a partial last line, which :func:`read_progress`
drops).

Children start from a ``forkserver`` that imported the plugin once
(:func:`child_context`): a fresh interpreter per child would import torch,
mmcv, mmseg and the plugin each time (seconds on a small CPU), which would
dominate a child that trains a few iterations. The server imports and
runs nothing else, so no thread pool is forked.
"""
import multiprocessing
import os
import os.path as osp
import time
from typing import Any, Callable, Dict, List, Tuple

from ..engine.checkpoint.atomic_write import PARTIAL_PREFIX

__all__ = ['read_progress', 'child_context', 'ChildRun']

#: Seconds a child may take before it is killed as hung.
CHILD_TIMEOUT = 600.0
_POLL = 0.01


def child_context():
    """The multiprocessing context of the children: a ``forkserver`` that
    imports :mod:`.fault_injection` (hence torch, mmseg and the plugin)
    once, where the platform has one; else ``spawn``."""
    if 'forkserver' not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context('spawn')
    context = multiprocessing.get_context('forkserver')
    context.set_forkserver_preload(['mmseg_gf.analysis.fault_injection'])
    return context


def read_progress(path: str) -> List[Tuple[str, int]]:
    """The complete ``(kind, number)`` lines of a progress file."""
    if not osp.isfile(path):
        return []
    with open(path) as f:
        text = f.read()
    lines = text.split('\n')[:-1]  # the last part is empty or partial
    out = []
    for line in lines:
        kind, _, number = line.partition(' ')
        out.append((kind, int(number)))
    return out


class ChildRun:
    """One child process training ``target(config, work_dir, progress,
    log, kill_write)`` (:func:`.fault_injection.child_main`)."""

    def __init__(self, target: Callable, config: str, work_dir: str,
                 progress: str, log: str) -> None:
        self.target = target
        self.args = (config, work_dir, progress, log)
        self.work_dir = work_dir
        self.progress = progress
        self.lines_before = len(read_progress(progress))

    def _wait_start(self, proc) -> bool:
        """Wait for the child's ``start`` line; False if it ended first."""
        while proc.is_alive():
            new = read_progress(self.progress)[self.lines_before:]
            if any(kind == 'start' for kind, _ in new):
                return True
            time.sleep(_POLL)
        return False

    def run(self, plan: Dict[str, Any]) -> int:
        """Run the child with ``plan`` (``kind``: None, ``'time'`` with
        ``delay`` seconds after its start, ``'write'`` with ``write`` and
        ``fraction``); returns its exit code (``-9``: killed).
        ``training_seconds``: from its start line to its end."""
        kill_write = ([plan['write'], plan['fraction']]
                      if plan.get('kind') == 'write' else None)
        proc = child_context().Process(
            target=self.target, args=self.args + (kill_write,))
        proc.start()
        self.training_seconds = None
        try:
            started = self._wait_start(proc)
            start = time.perf_counter()
            if plan.get('kind') == 'time' and started:
                proc.join(plan['delay'])
                if proc.is_alive():
                    proc.kill()
            proc.join(CHILD_TIMEOUT)
            if started:
                self.training_seconds = time.perf_counter() - start
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
        return proc.exitcode

    def report(self) -> Dict[str, Any]:
        """What the child reached: the iteration it resumed at
        (``started``), the last iteration it completed (``reached``), and
        the partial writes it left (the files a write kill cut)."""
        new = read_progress(self.progress)[self.lines_before:]
        starts = [n for kind, n in new if kind == 'start']
        iters = [n for kind, n in new if kind == 'iter']
        started = starts[0] if starts else None
        partial = sorted(n for n in os.listdir(self.work_dir)
                         if n.startswith(PARTIAL_PREFIX))
        return dict(started=started,
                    reached=iters[-1] if iters else started,
                    partial=[n[len(PARTIAL_PREFIX):].rsplit('.', 2)[0]
                             for n in partial])
