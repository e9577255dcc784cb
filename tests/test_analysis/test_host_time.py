"""``tools/count_launches.py --host-time`` on PSPNet-R18 (last 5 layers,
32x32, two profiled steps, the Triton path off: in-process, no
interpreter): the report's structure, its lean and vanilla rows and their
comparison; no timing is asserted (the figures depend on the machine)."""
import json

import pytest

pytest.importorskip('mmseg')

from mmseg_gf.analysis.host_time import TARGETS  # noqa: E402
from mmseg_gf.models import call_plans  # noqa: E402
from mmseg_gf.ops.backend import dispatch  # noqa: E402
from tests.helpers.tools import load_tool  # noqa: E402

count_launches = load_tool('count_launches')

_ROWS = ['gf_last5_r4:lean', 'vanilla_last5:plain']


@pytest.fixture(scope='module')
def report(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp('host_time')
    results = count_launches.main([
        '--models', 'pspnet_r18', '--rows', *_ROWS, '--host-time',
        '--no-triton', '--input-size', '32', '--steps', '2', '--warmup',
        '1', '--out-dir', str(out)])
    return out, results


def test_files_and_rows(report):
    out, results = report
    assert json.loads((out / 'host_time.json').read_text()) == \
        json.loads(json.dumps(results))
    text = (out / 'host_time.md').read_text()
    assert 'gf_last5_r4:lean' in text and 'host time per call' in text
    (result, ) = results
    assert [r['row'] for r in result['rows']] == _ROWS
    assert [r['lean'] for r in result['rows']] == [True, False]
    for row in result['rows']:
        step = row['step']
        assert step['wall_us'] == pytest.approx(step['host_us'] +
                                                step['aten_us'])
        assert step['host_us'] > 0 and step['aten_us'] > 0
        assert set(row['phases']) == {'forward', 'backward', 'optimizer'}
        assert sum(p['wall_us'] for p in row['phases'].values()) <= \
            step['wall_us'] * (1 + 1e-9)
        assert row['kinds'] and all(v['calls'] >= 0
                                    for v in row['kinds'].values())


def test_lean_against_vanilla(report):
    """One comparison, the lean row against its vanilla-same-layers row;
    per-kind overheads are the difference of their per-call times, the
    filtered conv against the plain conv."""
    _, (result, ) = report
    (c, ) = result['comparisons']
    assert (c['lean'], c['vanilla']) == tuple(_ROWS)
    lean, vanilla = result['rows']
    assert c['ratio'] == pytest.approx(lean['step']['host_us'] /
                                       vanilla['step']['host_us'])
    assert c['met'] == (c['ratio'] <= TARGETS['step'])
    kinds = {v['kind']: v for v in c['layers']}
    assert 'filtered_conv' in kinds and 'filtered_conv' not in \
        vanilla['kinds'] and 'conv' in vanilla['kinds']
    for v in c['layers']:
        assert v['overhead_us'] == pytest.approx(v['lean_us'] -
                                                 v['vanilla_us'])


def test_a_steady_step_decides_nothing(report):
    """After the warm-up, the profiled steps make no dispatcher choice
    without its cache and no call plan: each call's implementation and
    arguments were decided once, at its first step; the report says so."""
    out, (result, ) = report
    assert call_plans.plans_made() > 0 and dispatch.misses() > 0  # warm-up
    for row in result['rows']:
        assert row['decided'] == dict(dispatch_misses=0, plans_made=0)
    assert '0 dispatcher choices, 0 call plans' in \
        (out / 'host_time.md').read_text()


@pytest.mark.parametrize('argv, message', [
    (['--steps', '0'], '--steps'),
    (['--device', 'cuda'], '--device'),
    (['--run-kernels'], '--host-time'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        count_launches.parse_args(['--models', 'pspnet_r18', '--host-time',
                                   *argv])
    assert message in capsys.readouterr().err
