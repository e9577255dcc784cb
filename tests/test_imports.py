"""The package's layering: ``mmseg_gf.engine`` (what a training run needs)
imports neither ``mmseg_gf.analysis`` nor ``mmseg_gf.protocol`` when it is
imported, so the analysis code can build on the engine without a cycle."""
import subprocess
import sys

import pytest

pytest.importorskip('mmseg')

CHECK = """
import sys
import mmseg_gf.engine
print(' '.join(sorted(m for m in sys.modules
                      if m.startswith(('mmseg_gf.analysis',
                                       'mmseg_gf.protocol')))))
"""


def test_engine_imports_no_analysis_or_pipeline():
    proc = subprocess.run([sys.executable, '-c', CHECK], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ''
