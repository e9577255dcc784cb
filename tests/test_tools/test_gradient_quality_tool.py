"""tools/gradient_quality.py: per-layer SNR / cosine of filtered vs exact
gradients, Proposition 1, end-to-end weight gradients."""
import json
import math
import os.path as osp

import pytest

pytest.importorskip('mmseg')
pytest.importorskip('torch')

from tests.helpers.tools import REPO, load_tool  # noqa: E402

gradient_quality = load_tool('gradient_quality')

PSP = osp.join(REPO, 'configs', 'gf', 'pspnet_r18_voc_r4.py')


def test_r1_on_1x1_convs_is_exact(tmp_path, capsys):
    out = tmp_path / 'q.json'
    result = gradient_quality.main([
        PSP, '--shape', '48', '--batch', '1', '--out', str(out),
        '--cfg-options', 'gradient_filter.radius=1',
        'gradient_filter.num_layers=None',
        'gradient_filter.layers=[decode_head.psp_modules]'
    ])
    printed = capsys.readouterr().out
    assert '| decode_head.psp_modules.3.1.conv | 1 | inf |' in printed
    assert 'holds on 4 of 4 layers' in printed
    rows = result['rows']
    assert [r['path'] for r in rows] == [
        f'decode_head.psp_modules.{i}.1.conv' for i in range(4)
    ]
    for r in rows:
        # r = 1 on a 1x1 stride-1 conv: the filter is the identity and the
        # filtered gradients are the exact ones.
        assert r['snr_grad_output'] == 'inf'  # json: inf as a string
        for key in ('snr_grad_input_propagated', 'snr_grad_input',
                    'snr_grad_weight', 'e2e_snr_grad_weight'):
            assert r[key] == 'inf' or r[key] > 1e20, (key, r)
        for key in ('cos_grad_output', 'cos_grad_input', 'cos_grad_weight',
                    'e2e_cos_grad_weight'):
            assert r[key] == pytest.approx(1, abs=1e-12), (key, r)
        assert r['proposition1_holds']
    assert json.loads(out.read_text())['rows'] == rows


def test_r4_rows_are_consistent():
    result = gradient_quality.main(
        [PSP, '--shape', '64', '--batch', '2', '--label-block', '8'])
    rows = {r['path']: r for r in result['rows']}
    assert len(rows) == 5
    for r in rows.values():
        for key in ('cos_grad_output', 'cos_grad_input', 'cos_grad_weight'):
            assert -1 <= r[key] <= 1 + 1e-12
        snr_y, snr_x = (float(r['snr_grad_output']),
                        float(r['snr_grad_input_propagated']))
        assert r['proposition1_holds'] == (snr_x >= snr_y)
    # The bottleneck runs last: at r=4 on an 8x8 map the filter is lossy,
    # and nothing filtered lies upstream of it in the backward, so its
    # end-to-end weight-gradient error is its local one.
    last = rows['decode_head.bottleneck.conv']
    assert 1 < last['snr_grad_output'] < 1e6
    assert last['e2e_snr_grad_weight'] == pytest.approx(
        last['snr_grad_weight'], rel=1e-3)
    # The 1x1-map PPM branch is exact locally but receives the filtered
    # gradient of the bottleneck end to end.
    first = rows['decode_head.psp_modules.0.1.conv']
    assert first['snr_grad_output'] == 'inf'
    assert math.isfinite(first['e2e_snr_grad_weight'])
