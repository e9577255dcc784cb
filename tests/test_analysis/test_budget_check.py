"""The budget's predictions next to the built model's measurements
(mmseg_gf.analysis.budget_sweep.predicted_vs_measured), on a tiny segmentor
whose step peak depends on what the peak model gets right: a saved view of
a Parameter (never live bytes of the step), a measured storage that the
forward still holds when it is saved (a GroupNorm's input), and a wide
filtered conv whose weight gradient is made full-size after its output's
gradient is freed."""
import pytest
import torch
from torch import nn

pytest.importorskip('mmseg')

from mmengine.model import BaseModule  # noqa: E402
from mmcv.cnn import ConvModule  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

from mmseg_gf.analysis.budget_sweep import (families_markdown,  # noqa: E402
                                            predicted_vs_measured)
from tests.helpers.tiny_segmentors import (  # noqa: E402
    BN, fcn_head, tiny_segmentor)

SIZE = (32, 32)
BATCH = 2


@MODELS.register_module(force=True)
class AttentionTestBackbone(BaseModule):
    """stem conv -> conv + GroupNorm -> self-attention over the pixels
    (nn.MultiheadAttention: its products save views of the projection
    weights) -> conv."""

    def __init__(self):
        super().__init__()
        self.stem = ConvModule(3, 32, 3, 2, 1, norm_cfg=BN)
        self.conv1 = ConvModule(32, 64, 3, 2, 1,
                                norm_cfg=dict(type='GN', num_groups=8))
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.conv2 = ConvModule(64, 64, 3, 1, 1, norm_cfg=BN)

    def forward(self, x):
        x = self.conv1(self.stem(x))
        n, c, h, w = x.shape
        seq = x.flatten(2).transpose(1, 2)
        seq = seq + self.attn(seq, seq, seq, need_weights=False)[0]
        x = seq.transpose(1, 2).reshape(n, c, h, w)
        return (self.conv2(x), )


def _model():
    # a wide 3x3 conv: weight gradient 1024 x 64 x 3 x 3, output gradient
    # 2 x 1024 x 8 x 8
    return tiny_segmentor('AttentionTestBackbone', SIZE, fcn_head(64, 1024))


def test_predictions_equal_or_near_the_measurements():
    rows = predicted_vs_measured(_model(), SIZE, BATCH, [1, 2, None], 4)
    assert [r['num_layers'] for r in rows][:2] == [1, 2]
    assert rows[-1]['all'] and not rows[0]['all']
    for row in rows:
        assert row['predicted_kept'] == row['measured_kept'], row
        assert abs(row['predicted_peak'] / row['measured_peak'] - 1) \
            <= 0.05, row
    table = families_markdown([dict(label='tiny', rows=rows)])
    lines = table.splitlines()
    assert lines[0].startswith('| model | last 1: kept | last 1: peak |')
    assert 'all convs: peak' in lines[0] and lines[2].startswith('| tiny |')


@pytest.mark.parametrize('family', ['pidnet_s', 'ddrnet_23_slim'])
def test_own_loss_heads_kept_bytes_predicted_exactly(family):
    """PIDNet's and DDRNet's lean OHEM losses keep a gradient per logits
    tensor inside a custom Function (packed outside any operation): each is
    counted in the settings that train its logits' branch, and the fused
    classifiers' weight gradients at any batch, so the kept bytes of the
    last 10 convs and of all convs are predicted byte for byte."""
    from mmseg_gf.analysis.budget_sweep import family_predicted_vs_measured
    result = family_predicted_vs_measured(family, (128, 128), BATCH, 4,
                                          [10, None])
    for row in result['rows']:
        assert row['predicted_kept'] == row['measured_kept'], row
        assert abs(row['predicted_peak'] / row['measured_peak'] - 1) \
            <= 0.10, row


def test_the_step_peak_is_measured_with_cudnn_benchmark_off(monkeypatch):
    """cuDNN's benchmark mode (on in any process that built an mmengine
    Runner from mmseg's default_runtime) may pick algorithms with workspaces
    of GBs, which CUDA's peak counts and the budget does not model: the
    measurement turns it off for its steps and restores it."""
    from mmseg_gf.analysis import budget_sweep
    seen = []

    def peak(step, device):
        seen.append(torch.backends.cudnn.benchmark)
        step()
        return 1

    monkeypatch.setattr(budget_sweep, 'profiled_peak_bytes', peak)
    monkeypatch.setattr(torch.backends.cudnn, 'benchmark', True)
    assert budget_sweep.measured_step_peak(_model(), SIZE, BATCH) == 1
    assert seen == [False]
    assert torch.backends.cudnn.benchmark is True
