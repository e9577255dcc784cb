"""The kernels one training step launches, recorded on a GPU
(:mod:`mmseg_gf.accounting.cuda_kernels`, ``tools/count_launches.py
--device cuda``): every kernel falls in a phase, and the lean row's
recorded kernels and the CPU's count of the same row agree where both see
the same operators (the optimizer's update)."""
import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.analysis.launch_count import count_model  # noqa: E402
from mmseg_gf.protocol.experiments import step_jobs  # noqa: E402
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
