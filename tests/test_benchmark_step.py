"""tools/benchmark_step.py: whole training steps of the pipeline's
strategies, timed side by side (tiny crop here; real figures in the README).
"""
import os.path as osp
import sys

import pytest

pytest.importorskip('mmseg')

sys.path.insert(0, osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))),
                            'tools'))
import benchmark_step  # noqa: E402


def test_steps_of_three_strategies(tmp_path, capsys):
    out = tmp_path / 'steps.json'
    rows = benchmark_step.main([
        '--model', 'pspnet_r18', '--crop', '64', '64', '--batch', '2',
        '--repeats', '1', '--warmup', '0', '--strategies', 'vanilla_all',
        'vanilla_last5', 'gf_last5_r4', '--out', str(out)
    ])
    by = {r['strategy']: r for r in rows}
    for r in rows:
        assert r['forward'] > 0 and r['backward'] > 0
        assert r['step'] >= r['forward'] + r['backward']
    # The same five convs (+ classifier) are trained by the vanilla and the
    # filtered last-5 strategy; everything is trained by vanilla_all.
    assert by['vanilla_last5']['trainable_params'] == \
        by['gf_last5_r4']['trainable_params']
    assert by['vanilla_all']['trainable_params'] > \
        5 * by['gf_last5_r4']['trainable_params']
    table = capsys.readouterr().out
    assert '| gf_last5_r4 |' in table and '20k steps (h)' in table
    assert out.exists()
