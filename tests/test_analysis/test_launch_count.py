"""``tools/count_launches.py`` on the four models of the launch targets
(64x64, batch 1; ``tests/helpers/launches_golden.py``): the counts are those of
``tests/golden/launches_64.json``, every launch has one phase and one kind,
and the lean and vanilla rows differ where they must."""
import pytest

pytest.importorskip('mmseg')

from tests.helpers import launches_golden as golden  # noqa: E402
from tests.helpers.triton_runs import INTERPRETER, TRITON  # noqa: E402

pytestmark = [TRITON, INTERPRETER]

_LEAN_ONLY = {'patch_sums', 'filtered_conv', 'filtered_linear', 'fused_loss',
              'resized_loss'}


# Each model counts in 10-20 s (the build's layer selection and traces
# run with the Triton path off); the zoo families are deselected with
# -m "not zoo".
_PARAMS = [pytest.param(m, marks=() if m == 'pspnet_r18' else pytest.mark.zoo)
           for m in sorted(golden.MODELS)]


@pytest.fixture(scope='module', params=_PARAMS)
def counted(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    results = golden.run_tool(request.param, str(out))
    assert (out / 'launches.md').read_text().count('| ') > 4
    return request.param, results[0]


def _rows(result):
    lean = next(r for r in result['rows'] if r['lean'])
    vanilla = next(r for r in result['rows'] if not r['lean'])
    return lean, vanilla


def test_counts_are_the_golden_files(counted):
    model, result = counted
    assert golden.held(result) == golden.load()['counts'][model], (
        'the launches changed: if on purpose, `python tests/'
        'launches_golden.py --write` and commit the diff')


def test_phases_and_kinds_add_up(counted):
    _, result = counted
    for row in result['rows']:
        step = row['step']
        for key in ('launches', 'triton', 'read_bytes', 'written_bytes',
                    'host_reads'):
            assert step[key] == sum(row[p][key] for p in
                                    ('forward', 'backward', 'optimizer'))
        for phase in ('forward', 'backward', 'optimizer', 'step'):
            assert sum(row[phase]['by_kind'].values()) == \
                row[phase]['launches']
            assert sum(row[phase]['by_op'].values()) == \
                row[phase]['launches']


def test_lean_and_vanilla_rows(counted):
    """The lean row launches the Triton kernels (patch sums forward, the
    filtered backward) and its kinds; vanilla none of them; both update
    the same parameters with the same launches; the ratios are theirs."""
    _, result = counted
    lean, vanilla = _rows(result)
    assert lean['forward']['triton'] > 0 and lean['backward']['triton'] > 0
    assert lean['forward']['by_kind']['patch_sums'] > 0
    assert _LEAN_ONLY & set(lean['backward']['by_kind'])
    assert vanilla['step']['triton'] == 0
    assert not _LEAN_ONLY & set(vanilla['step']['by_kind'])
    assert lean['optimizer'] == vanilla['optimizer']
    (comparison, ) = result['comparisons']
    for phase in ('forward', 'backward', 'step'):
        assert comparison['ratios'][phase] == pytest.approx(
            lean[phase]['launches'] / vanilla[phase]['launches'])
    moved = [r['step']['read_bytes'] + r['step']['written_bytes']
             for r in (lean, vanilla)]
    assert comparison['ratios']['bytes'] == pytest.approx(
        moved[0] / moved[1])
    assert comparison['met']['forward'] == (
        comparison['ratios']['forward'] <= 1.1)
