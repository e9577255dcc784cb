"""tools/benchmark_step.py: whole steps next to inference, with peak and
saved bytes (tiny crop here; the real figures are in docs/results.md)."""
import json
import os.path as osp

import pytest

pytest.importorskip('mmseg')

from mmseg_gf.analysis.step_benchmark import row_settings  # noqa: E402
from mmseg_gf.analysis.step_jobs import family_crop  # noqa: E402
from tests.helpers.tools import REPO, load_tool  # noqa: E402

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


PSP_CONFIG = osp.join(REPO, 'configs', 'gf', 'pspnet_r18_voc_r4.py')


def test_a_config_file_measures_as_the_protocol_model(tmp_path):
    """A user's config with rows as settings measures the same bytes as
    the protocol's own composition of the same model and strategies
    (configs/gf/pspnet_r18_voc_r4.py is the protocol's PSPNet-R18 on VOC;
    its own gradient_filter is replaced by each row's)."""
    rows = ['inference', 'vanilla_last5:plain', 'gf_last5_r4:lean']
    common = ['--crop', '64', '--batch', '2', '--repeats', '0', '--rows',
              *rows]
    by_config, = benchmark_step.main(
        [PSP_CONFIG, *common, '--out-dir', str(tmp_path / 'config')])
    by_model, = benchmark_step.main(
        ['--models', 'pspnet_r18', *common, '--out-dir',
         str(tmp_path / 'model')])
    assert by_config['model'] == 'pspnet_r18_voc_r4'
    assert by_config['crop'] == [64, 64]
    for got, want in zip(by_config['rows'], by_model['rows']):
        assert got['row'] == want['row']
        for key in ('saved_bytes', 'trainable_params'):
            assert got[key] == want[key], (got['row'], key)
    lean = by_config['rows'][2]
    assert lean['saved_bytes'] == lean['analytic_saved_bytes']
    assert lean['saved_vs_vanilla_plain'] < 1 / 8


def test_a_family_by_name_memory_only(tmp_path, capsys):
    """--families: mmseg's own config, offline, at the given crop; a
    memory-only run still plots what it measured."""
    result, = benchmark_step.main([
        '--families', 'fast_scnn', '--crop', '64', '--batch', '2',
        '--repeats', '0', '--rows', 'inference', 'gf_last5_r4:lean',
        '--out-dir', str(tmp_path)])
    assert result['label'] == 'Fast-SCNN' and result['crop'] == [64, 64]
    lean = result['rows'][1]
    assert 'step' not in lean and lean['peak_vs_inference'] > 0
    assert lean['saved_bytes'] == lean['analytic_saved_bytes']
    text = (tmp_path / 'steps.md').read_text()
    assert '## Fast-SCNN, crop 64x64' in text
    # the lean row's kept bytes by kind, which add up to its total
    assert sum(lean['analytic_by_category'].values()) == \
        lean['analytic_saved_bytes']
    assert 'Kept for backward by kind' in text
    assert '| gf_last5_r4:lean | ' in text.split('by kind')[1]
    assert (tmp_path / 'steps.png').stat().st_size > 0


def test_kept_by_kind_table_lists_the_kinds_that_keep_bytes():
    from mmseg_gf.analysis.step_report import kept_by_kind_table
    mib = 2**20
    result = dict(rows=[
        dict(row='inference'),
        dict(row='gf_last5_r4:lean', analytic_saved_bytes=3 * mib,
             analytic_by_category=dict(conv=mib, norm=0, attention=2 * mib)),
        dict(row='gf_last9_r4:lean', analytic_saved_bytes=mib,
             analytic_by_category=dict(conv=mib, norm=0, attention=0))])
    lines = kept_by_kind_table(result).splitlines()
    assert lines[0].split('|')[1:-1] == [
        ' row (kept MiB) ', ' total ', ' conv ', ' attention ']
    assert [c.strip() for c in lines[2].split('|')[1:-1]] == [
        'gf_last5_r4:lean', '3.0', '1.0', '2.0']
    assert len(lines) == 4
    assert kept_by_kind_table(dict(rows=[dict(row='inference')])) == ''


def test_transformers_names_the_transformer_families():
    from mmseg_gf.engine.zoo import TRANSFORMER_FAMILIES
    args = benchmark_step.parse_args(['--families', 'transformers'])
    assert args.families == ['segformer_b0', *TRANSFORMER_FAMILIES]
    assert {'swin_t', 'deit_s', 'segmenter_vit_t'} <= set(args.families)


@pytest.mark.parametrize('row, settings', [
    ('inference', None),
    ('vanilla_all', None),
    ('vanilla_last10:plain', dict(num_layers=10, mode='vanilla',
                                  lean=False)),
    ('gf_last5_r4', dict(num_layers=5, mode='gf', lean=True, radius=4)),
    ('gf_last3_auto:lean', dict(num_layers=3, mode='gf', lean=True,
                                radius='auto')),
])
def test_row_settings(row, settings):
    assert row_settings(row) == settings


def test_compiled_rows_take_the_setting_and_the_mode():
    """'+compiled' keeps the row's setting; with such rows only they are
    compiled (default mode 'default'), without them --compile compiles
    every training row; inference never."""
    from mmseg_gf.analysis.step_benchmark import (parse_row,
                                                  row_compile_modes)
    assert row_settings('gf_last5_r4:lean+compiled') == row_settings(
        'gf_last5_r4:lean')
    assert parse_row('vanilla_last5:plain+compiled') == ('vanilla_last5',
                                                        False)
    rows = ['inference', 'gf_last5_r4:lean', 'gf_last5_r4:lean+compiled']
    assert row_compile_modes(rows, None) == [None, None, 'default']
    assert row_compile_modes(rows, 'max-autotune') == [None, None,
                                                       'max-autotune']
    assert row_compile_modes(rows[:2], 'default') == [None, 'default']
    assert row_compile_modes(rows[:2], None) == [None, None]


def test_compiled_rows_are_compared_with_their_eager_twins():
    """A compiled row's step against the same row eager; lean against
    plain within the compiled rows and within the eager ones."""
    from mmseg_gf.analysis.step_benchmark import _add_ratios
    from mmseg_gf.analysis.step_report import step_table

    def row(name, step, compiled=None):
        strategy, lean = name.split('+')[0].split(':')
        return dict(row=name, strategy=strategy, lean=lean == 'lean',
                    compiled=compiled, step=step, forward=step / 2,
                    backward=step / 2, peak_bytes=None, saved_bytes=None)

    rows = [row('gf_last5_r4:lean', 4.0), row('gf_last5_r4:plain', 5.0),
            row('gf_last5_r4:lean+compiled', 3.0, 'default'),
            row('gf_last5_r4:plain+compiled', 6.0, 'default')]
    _add_ratios(rows)
    by = {r['row']: r for r in rows}
    assert by['gf_last5_r4:lean+compiled']['step_vs_eager'] == 0.75
    assert by['gf_last5_r4:plain+compiled']['step_vs_eager'] == 1.2
    assert by['gf_last5_r4:lean+compiled']['step_vs_plain'] == 0.5
    assert by['gf_last5_r4:lean']['step_vs_plain'] == 0.8
    assert 'step_vs_eager' not in by['gf_last5_r4:lean']
    table = step_table(dict(rows=rows))
    assert 'compiled / eager step' in table
    assert '| gf_last5_r4:lean+compiled |' in table and '| 0.750 |' in table


@pytest.mark.parametrize('row', ['gf_last5', 'vanilla_last5_r4',
                                 'gf_last0_r4', 'gf_last5_r0', 'last5',
                                 'gf_last5_r4:fast', 'inference+compiled'])
def test_bad_rows_are_refused_before_building(row, capsys):
    with pytest.raises(SystemExit):
        benchmark_step.main(['--families', 'stdc1', '--rows', row])
    assert '--rows' in capsys.readouterr().err


def test_a_row_the_protocol_has_no_strategy_for_is_refused(capsys):
    """The protocol's models take its built-in strategies only (a family
    takes any N): refused while parsing, the strategies named."""
    with pytest.raises(SystemExit):
        benchmark_step.parse_args(['--models', 'pspnet_r18', '--rows',
                                   'inference', 'gf_last20_r4:lean'])
    err = capsys.readouterr().err
    assert "--rows: unknown strategy 'gf_last20_r4'" in err
    assert 'gf_last10_r4' in err
    benchmark_step.parse_args(['--families', 'stdc1', '--rows',
                               'gf_last20_r4:lean'])


def test_family_crops():
    """--crop is raised to a family's minimum side; --family-crop sets
    one family's crop; without either, the config's training crop."""
    args = benchmark_step.parse_args([
        '--families', 'lraspp_mv3', 'stdc1', 'cgnet', '--crop', '256',
        '--family-crop', 'cgnet=128'])
    assert family_crop('lraspp_mv3', args) == (392, 392)
    assert family_crop('stdc1', args) == (256, 256)
    assert family_crop('cgnet', args) == (128, 128)
    args = benchmark_step.parse_args(['--families', 'all'])
    assert len(args.families) == 12
    assert family_crop('stdc1', args) == (512, 1024)
    with pytest.raises(SystemExit):
        benchmark_step.parse_args([])
    with pytest.raises(SystemExit):
        benchmark_step.parse_args(['--families', 'stdc1', '--family-crop',
                                   'cgnet=64'])


def test_the_plot_draws_only_what_was_measured(tmp_path):
    """A memory-only run plots peak and kept ratios, a --no-memory run the
    time ratio only; the vanilla rows' own kept ratio (1) is not drawn."""
    from mmseg_gf.analysis.step_report import _measured_panels, plot

    def result(memory: bool, timed: bool):
        rows = [dict(row='inference', lean=None)]
        for name, kept in (('vanilla_last5:plain', 1.0),
                           ('gf_last5_r4:lean', 0.1)):
            row = dict(row=name, lean=name.endswith('lean'))
            if memory:
                row.update(peak_vs_inference=1.5,
                           saved_vs_vanilla_plain=kept)
            if timed:
                row.update(step_vs_inference=1.2)
            rows.append(row)
        return dict(model='m', label='M', crop=[64, 64], batch=2,
                    threads=1, torch='x', rows=rows)

    names = ['vanilla_last5:plain', 'gf_last5_r4:lean']
    panels = _measured_panels([result(True, False)], names)
    assert [(p[0], p[3]) for p in panels] == [
        ('peak_vs_inference', names),
        ('saved_vs_vanilla_plain', ['gf_last5_r4:lean'])]
    panels = _measured_panels([result(False, True)], names)
    assert [p[0] for p in panels] == ['step_vs_inference']
    assert not plot([result(False, False)], str(tmp_path / 'none.png'))
    assert not (tmp_path / 'none.png').exists()
    assert plot([result(True, True)], str(tmp_path / 'all.png'))


def test_cfg_options_reach_every_kind_of_model():
    """--cfg-options is merged into --models rows as into configs and
    families (nothing is built)."""
    args = benchmark_step.parse_args([
        '--models', 'fcn_r18', '--families', 'stdc1', '--rows', 'inference',
        'gf_last5_r4:lean', '--cfg-options',
        'model.decode_head.dropout_ratio=0.3'])
    jobs = benchmark_step._jobs(args)
    assert [job[0] for job in jobs] == ['stdc1', 'fcn_r18']
    for _, _, _, rows in jobs:
        assert [row for row, _ in rows] == ['inference', 'gf_last5_r4:lean']
        assert all(cfg.model.decode_head.dropout_ratio == 0.3
                   for _, cfg in rows)


def test_reuse_cpu_memory_is_applied_and_recorded(tmp_path):
    """--reuse-cpu-memory keeps freed memory for the whole process (run in
    a subprocess, not to change the test worker's allocator)."""
    import subprocess
    import sys
    proc = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'benchmark_step.py'),
         '--models', 'fcn_r18', '--crop', '64', '64', '--batch', '1',
         '--repeats', '1', '--warmup', '0', '--no-memory', '--rows',
         'inference', 'gf_last5_r4:lean', '--reuse-cpu-memory', '--out-dir',
         str(tmp_path)], cwd=REPO, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'freed CPU memory reused' in proc.stdout
    assert 'resident after them' in proc.stdout
    result, = json.loads((tmp_path / 'steps.json').read_text())
    assert result['reuse_cpu_memory'] is True
    # two models and torch: well over 100 MiB, under the machine's memory
    assert 100 * 2**20 < result['resident_bytes'] < 16 * 2**30
    assert result['resident_bytes'] <= result['peak_resident_bytes']
