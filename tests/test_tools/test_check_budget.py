"""tools/check_budget.py: the budget's predictions next to the built
model's measurements, for protocol models and real-time families, at
several settings."""
import json

import pytest

pytest.importorskip('mmseg')

from tests._tools import load_tool  # noqa: E402

check_budget = load_tool('check_budget')


def test_protocol_model_at_several_settings(tmp_path, capsys):
    out = tmp_path / 'budget.json'
    results = check_budget.main([
        '--models', 'fcn_r18', '--shape', '64', '64', '--batch', '1',
        '--last', '2', '5', '--no-all-convs', '--out', str(out)])
    printed = capsys.readouterr().out
    result, = results
    assert result['model'] == 'fcn_r18' and result['label'] == 'FCN-R18'
    assert [r['num_layers'] for r in result['rows']] == [2, 5]
    for row in result['rows']:
        assert row['predicted_kept'] == row['measured_kept'], row
        assert abs(row['predicted_peak'] / row['measured_peak'] - 1) \
            <= 0.10, row
    assert '| model | last 2: kept | last 2: peak | last 5: kept |' in printed
    assert json.loads(out.read_text())['results'][0]['rows'] == \
        result['rows']


def test_families_by_default_and_bad_settings(capsys):
    args = check_budget.parse_args(['--shape', '64', '64'])
    assert args.families and not args.models
    assert all(name != 'lraspp_mv3' for name in args.families)  # 392 min
    assert check_budget.parse_args(['--models', 'all']).families == []
    with pytest.raises(SystemExit):
        check_budget.parse_args(['--last', '0'])
    assert '--last: N >= 1' in capsys.readouterr().err
