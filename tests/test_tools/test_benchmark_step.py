"""tools/benchmark_step.py: whole steps next to inference, with peak and
saved bytes (tiny crop here; the real figures are in the README)."""
import json

import pytest

pytest.importorskip('mmseg')

from tests._tools import load_tool  # noqa: E402

benchmark_step = load_tool('benchmark_step')


def test_rows_ratios_and_files(tmp_path, capsys):
    results = benchmark_step.main([
        '--models', 'pspnet_r18', '--crop', '64', '64', '--batch', '2',
        '--repeats', '1', '--warmup', '0', '--rows', 'inference',
        'vanilla_last5:plain', 'gf_last5_r4:plain', 'gf_last5_r4:lean',
        '--out-dir', str(tmp_path)
    ])
    by = {r['row']: r for r in results[0]['rows']}
    inference = by['inference']
    assert inference['peak_bytes'] > 0 and inference['saved_bytes'] == 0
    for name in ('vanilla_last5:plain', 'gf_last5_r4:plain',
                 'gf_last5_r4:lean'):
        r = by[name]
        assert r['forward'] > 0 and r['backward'] > 0
        assert r['step'] >= r['forward'] + r['backward']
        assert r['peak_vs_inference'] == pytest.approx(
            r['peak_bytes'] / inference['peak_bytes'])
    # the same layers: saved bytes shrink from exact to filtered to lean
    vanilla, gf, lean = (by[n]['saved_bytes'] for n in (
        'vanilla_last5:plain', 'gf_last5_r4:plain', 'gf_last5_r4:lean'))
    assert lean < gf < vanilla
    assert by['gf_last5_r4:lean']['saved_vs_vanilla_plain'] == \
        pytest.approx(lean / vanilla)
    assert by['gf_last5_r4:lean']['analytic_saved_bytes'] == lean
    assert by['gf_last5_r4:lean']['trainable_params'] == \
        by['vanilla_last5:plain']['trainable_params']
    assert '| gf_last5_r4:lean |' in capsys.readouterr().out
    for ext in ('json', 'md', 'png'):
        assert (tmp_path / f'steps.{ext}').stat().st_size > 0
    assert json.loads((tmp_path / 'steps.json').read_text())[0]['model'] == \
        'pspnet_r18'


def test_no_memory_times_the_rows_only(tmp_path):
    results = benchmark_step.main([
        '--models', 'fcn_r18', '--crop', '64', '64', '--batch', '1',
        '--repeats', '1', '--warmup', '0', '--no-memory', '--rows',
        'inference', 'gf_last5_r4:plain', 'gf_last5_r4:lean', '--out-dir',
        str(tmp_path)
    ])
    by = {r['row']: r for r in results[0]['rows']}
    for r in by.values():
        assert r['peak_bytes'] is None and r['saved_bytes'] is None
        assert 'peak_vs_inference' not in r
    lean = by['gf_last5_r4:lean']
    assert lean['step_vs_plain'] == pytest.approx(
        lean['step'] / by['gf_last5_r4:plain']['step'])
    assert lean['step_vs_inference'] == pytest.approx(
        lean['step'] / by['inference']['forward'])
    assert (tmp_path / 'steps.png').stat().st_size > 0
