"""What the Triton tests share.

Triton decides when it is imported whether its kernels run compiled or in
its interpreter (``TRITON_INTERPRET``), so the kernel cases live in case
files (``tests/helpers/triton_cases.py``,
``tests/helpers/triton_linear_cases.py``) that the test modules run in a
subprocess (:func:`run_case_file`); a case file asks
:func:`case_device` where its tensors go. :func:`pytorch_path` switches the
Triton path and the compiled CPU kernels off, for a reference run.
"""
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from mmseg_gf.ops.backend import availability, switches, triton_runtime
from tests.helpers.devices import kernels_off, needs_cuda
from tests.helpers.tools import REPO

__all__ = ['ROOT', 'TRITON_VERSION', 'TRITON', 'INTERPRETER', 'CASE_RUNS',
           'run_case_file', 'case_device', 'triton_enabled', 'pytorch_path']

ROOT = Path(REPO)
TRITON_VERSION = triton_runtime.triton_version() or (0, )
_MIN = '.'.join(map(str, triton_runtime.MIN_TRITON))
#: Skips a test where triton (>= MIN_TRITON) is not installed.
TRITON = pytest.mark.skipif(
    not availability.triton_installed(),
    reason=f'triton >= {_MIN} is not installed (requirements/tests.txt '
    'pins it)' + ('' if triton_runtime.triton_version() is None else
                  f', found {triton_runtime.triton_version()}'))
# triton < 3.7's interpreter reads a loop bound with int() of a 1-element
# array, which numpy >= 2.4 refuses: an interpreter bug, not the kernels'.
#: Skips a test that needs triton's interpreter where it cannot run.
INTERPRETER = pytest.mark.skipif(
    TRITON_VERSION < (3, 7) and tuple(
        int(v) for v in np.__version__.split('.')[:2]) >= (2, 4),
    reason="triton < 3.7's interpreter does not run with numpy >= 2.4")


#: The two runs of a case file, as a test's ``interpret`` parameter:
#: interpreted on CPU tensors (every machine with triton), compiled on CUDA
#: (where a GPU is; ``cuda``-marked).
CASE_RUNS = [pytest.param(True, id='interpreted', marks=INTERPRETER),
             pytest.param(False, id='cuda',
                          marks=[pytest.mark.cuda, needs_cuda])]


def run_case_file(name: str, interpret: bool, *args: str) -> str:
    """``pytest tests/helpers/<name>`` in a subprocess, interpreted (CPU
    tensors) or compiled (CUDA); asserts that every case ran and passed (none
    skipped) and returns its report."""
    env = dict(os.environ, TRITON_INTERPRET='1' if interpret else '0')
    env.pop('MMSEG_GF_TRITON', None)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (str(ROOT), env.get('PYTHONPATH')) if p)
    proc = subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider',
         '-rs', str(ROOT / 'tests' / 'helpers' / name), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert ' passed' in report and ' failed' not in report, report
    assert 'skipped' not in report, report
    return report


def case_device() -> str:
    """Where a case file's tensors go: ``'cpu'`` under the interpreter,
    else ``'cuda'``; skips the whole file (called at its import) where
    triton is missing, or neither is possible."""
    if not availability.triton_installed():
        pytest.skip(f'triton >= {_MIN} is not installed '
                    '(triton_runtime.MIN_TRITON)', allow_module_level=True)
    if switches.value('TRITON_INTERPRET'):
        return 'cpu'
    import torch
    if not torch.cuda.is_available():
        pytest.skip('neither TRITON_INTERPRET=1 nor a CUDA GPU',
                    allow_module_level=True)
    return 'cuda'


triton_enabled = availability.triton_switched


@contextlib.contextmanager
def pytorch_path() -> Iterator[None]:
    """The pure-PyTorch path: the Triton path and the compiled CPU kernels
    off inside the block."""
    with triton_enabled(False), kernels_off():
        yield
