"""tools/benchmark_fused_loss.py on a tiny FCN-R18 (the real figures are in
docs/lean_region.md): three variants, kept bytes measured equal to the
analytic count, the fused step keeping least."""
import re

import pytest
import torch

pytest.importorskip('mmseg')

from tests.helpers.engine_fixtures import model_cfg, write_cfg  # noqa: E402
from tests.helpers.tools import load_tool  # noqa: E402

benchmark_fused_loss = load_tool('benchmark_fused_loss')


def test_kept_bytes_and_times(tmp_path, capsys):
    config = write_cfg(str(tmp_path / 'fcn.py'),
                       dict(model=model_cfg('fcn_r18')))
    times = benchmark_fused_loss.main([
        config, '--size', '32', '32', '--batch', '2', '--num-layers', '2',
        '--repeats', '1',
        # the process's own count: the tool sets it for the whole process
        '--threads', str(torch.get_num_threads())])
    assert set(times) == {'lean=False', 'lean, unfused', 'lean, fused'}
    assert all(len(t) == 1 and t[0] > 0 for t in times.values())
    out = capsys.readouterr().out
    kept = {m.group(1).strip(): (float(m.group(2)), m.group(3))
            for m in re.finditer(
                r'^(lean[^k]*?)\s+kept\s+([\d.]+) MiB(?: \(analytic '
                r'([\d.]+))?', out, re.M)}
    assert kept['lean, fused'][0] < kept['lean, unfused'][0] < \
        kept['lean=False'][0]
    for name in ('lean, unfused', 'lean, fused'):
        assert float(kept[name][1]) == kept[name][0]
