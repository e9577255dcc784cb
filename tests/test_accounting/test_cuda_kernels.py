"""The kernels one training step launches, recorded on a GPU
(:mod:`mmseg_gf.accounting.cuda_kernels`, ``tools/count_launches.py
--device cuda``): every kernel falls in a phase, and the lean row's
recorded kernels and the CPU's count of the same row agree where both see
the same operators (the optimizer's update)."""
import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.analysis.launch_count import (count_model,  # noqa: E402
                                             time_table)
from mmseg_gf.protocol.run_config import step_jobs  # noqa: E402
from tests.helpers.devices import needs_cuda  # noqa: E402
from tests.helpers.tools import load_tool  # noqa: E402


ROWS = ('vanilla_last10:plain', 'gf_last10_r4:lean')


@pytest.mark.cuda
@needs_cuda
def test_recorded_kernels_fall_in_their_phases():
    job = step_jobs(['pspnet_r18'], 'voc', ROWS, (64, 64))[0]
    result = count_model(job, batch=1, device='cuda')
    for row in result['rows']:
        phases = [row[p]['launches'] for p in ('forward', 'backward',
                                               'optimizer')]
        assert min(phases) > 0, row
        assert sum(phases) == row['step']['launches']
        for p in ('forward', 'backward', 'optimizer', 'step'):
            # kernels run inside their phase's host range
            assert 0 < row[p]['gpu_us'] <= row[p]['host_us'], (p, row[p])
            assert sum(row[p]['time_by_op'].values()) == pytest.approx(
                row[p]['gpu_us'])
    vanilla, lean = result['rows']
    # foreach SGD over the same parameters: the same update kernels
    assert lean['optimizer']['launches'] == vanilla['optimizer']['launches']
    assert result['comparisons'][0]['ratios']['forward'] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason='a CUDA machine')
def test_without_cuda_the_tool_refuses_device_cuda(capsys):
    tool = load_tool('count_launches')
    with pytest.raises(SystemExit):
        tool.parse_args(['--models', 'pspnet_r18', '--device', 'cuda'])
    assert 'no CUDA GPU is available' in capsys.readouterr().err


def test_time_table_shows_host_and_device_time_per_phase():
    """The GPU record's table: host and busy milliseconds per phase, their
    ratio, and each row's longest kernels in order."""
    def phase(host, busy, kernels):
        return dict(launches=sum(n for n, _ in kernels.values()),
                    host_us=host, gpu_us=busy,
                    by_op={k: n for k, (n, _) in kernels.items()},
                    time_by_op={k: t for k, (_, t) in kernels.items()})

    fwd = phase(2000.0, 500.0, {'gemm': (2, 400.0), 'relu': (3, 100.0)})
    bwd = phase(1000.0, 900.0, {'gemm_bwd': (1, 900.0)})
    opt = phase(100.0, 10.0, {'foreach': (1, 10.0)})
    step = phase(3100.0, 1410.0, {'gemm_bwd': (1, 900.0),
                                  'gemm': (2, 400.0), 'relu': (3, 100.0),
                                  'foreach': (1, 10.0)})
    result = dict(rows=[dict(row='gf_last10_r4:lean', forward=fwd,
                             backward=bwd, optimizer=opt, step=step)])
    text = time_table(result, top=2)
    lines = text.splitlines()
    forward = next(l for l in lines if '| forward |' in l)
    assert '2.00' in forward and '0.50' in forward and '0.25' in forward
    longest = lines[lines.index(next(l for l in lines
                                     if 'longest kernels' in l)):]
    body = [l for l in longest if l.startswith('| gemm') or
            l.startswith('| relu')]
    assert [l.split('|')[1].strip() for l in body] == ['gemm_bwd', 'gemm']
