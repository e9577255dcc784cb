"""tools/check_budget.py: the budget's predictions next to the built
model's measurements, for protocol models and real-time families, at
several settings."""
import json

import pytest

pytest.importorskip('mmseg')

from tests.helpers.tools import load_tool  # noqa: E402

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


FCN_CONFIG = 'configs/gf/fcn_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512.py'


def test_config_file_is_built_plain_and_profiler_quiet(capfd):
    """A CONFIG (with its own gradient_filter: left out) gives the same
    rows as the protocol model of the same architecture; torch's profiler
    lines (two per profiled step, from C++) are not printed."""
    by_file, by_name = check_budget.main([
        FCN_CONFIG, '--models', 'fcn_r18', '--shape', '64', '64',
        '--batch', '1', '--last', '3', '--no-all-convs'])
    assert by_file['config'] == FCN_CONFIG and by_name['model'] == 'fcn_r18'
    assert by_file['layer_kinds'] == ['conv2d']
    for a, b in zip(by_file['rows'], by_name['rows']):
        assert a['predicted_kept'] == b['predicted_kept'] == \
            a['measured_kept'] == b['measured_kept'], (a, b)
    out, err = capfd.readouterr()
    assert 'profiler_start' not in err and 'profiler_stop' not in err, err
    assert 'fcn_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512 |' in out


@pytest.mark.zoo
def test_transformer_family_over_every_kind(capfd):
    result, = check_budget.main([
        '--families', 'segformer_b0', '--layer-kinds', 'all', '--shape',
        '64', '64', '--batch', '1', '--last', '10', '--no-all-convs'])
    assert result['layer_kinds'] is None
    row, = result['rows']
    assert abs(row['predicted_kept'] / row['measured_kept'] - 1) <= 0.10, row
    out = capfd.readouterr().out
    assert 'layers: every kind' in out and '| Segformer-B0 |' in out


def test_family_groups_and_layer_kinds():
    from mmseg_gf.engine.zoo import TRANSFORMER_FAMILIES
    args = check_budget.parse_args(['--families', 'transformers'])
    assert args.families == ['segformer_b0', *TRANSFORMER_FAMILIES]
    assert args.layer_kinds == ['conv2d']  # the paper's count by default
    assert check_budget.parse_args(
        ['--families', 'swin_t', '--layer-kinds', 'all']).layer_kinds is None
    args = check_budget.parse_args([FCN_CONFIG])
    assert args.configs == [FCN_CONFIG] and args.families == []


def test_missing_config_file_is_refused(capsys):
    with pytest.raises(SystemExit):
        check_budget.parse_args(['no/such/config.py'])
    assert "CONFIG: file 'no/such/config.py' does not exist" in \
        capsys.readouterr().err
