"""tools/benchmark_loss.py on tiny shapes: every way runs, the resized
cross-entropy keeps a smaller peak than mmseg's upsample + cross-entropy
under autograd (the real figures are in docs/lean_region.md)."""
import json

import pytest

from mmseg_gf.ops.resized_loss import loss as resized_loss
from tests.helpers.tools import load_tool

benchmark_loss = load_tool('benchmark_loss')


@pytest.mark.parametrize('sigmoid', [False, True])
def test_ways_and_peaks(tmp_path, capsys, sigmoid):
    out = tmp_path / 'loss.json'
    argv = ['--classes', '7', '--logits', '8', '8', '--label', '32', '32',
            '--batch', '2', '--repeats', '1', '--out', str(out)]
    rows = benchmark_loss.main(argv + (['--sigmoid'] if sigmoid else []))
    ways = [r['way'] for r in rows]
    want = ['autograd', 'per_image']
    if resized_loss._kernel is not None:
        want.append('kernel')
    assert ways == want
    peak = {r['way']: r['peak_bytes'] for r in rows}
    upsampled = 2 * 7 * 32 * 32 * 4  # the batch's upsampled logits
    assert peak['autograd'] >= upsampled
    assert peak['per_image'] < peak['autograd']
    if 'kernel' in peak:
        assert peak['kernel'] < upsampled // 2
    assert all(r['seconds'] > 0 for r in rows)
    assert json.loads(out.read_text())['rows'][0]['way'] == 'autograd'
    assert 'cross-entropy' in capsys.readouterr().out
