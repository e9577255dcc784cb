"""The parent's side of one fault-injection child: start it, kill it, read
what it reached.

Progress goes to a file, so a kill mid-line leaves at most a partial last
line (dropped). Children start from a ``forkserver`` that imported the
plugin once: a fresh interpreter per child would spend seconds importing.
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
    """A ``forkserver`` context that imports the plugin once; else
    ``spawn``."""
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
    """One child process training as :func:`.fault_injection.child_main`."""

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
        """Run the child with ``plan`` (no kill, ``'time'`` or ``'write'``);
        returns its exit code."""
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
        """What the child reached: ``started``, ``reached`` and the partial
        writes left."""
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
