"""GradientQualityHook records a step and publishes SNR / cosine figures."""
from types import SimpleNamespace

import pytest
import torch
from mmengine.logging import MessageHub, MMLogger
from torch import nn

from mmseg_gf import GFConv2d
from mmseg_gf.engine.hooks import GradientQualityHook


def test_hook_logs_quality_of_each_filtered_layer_on_its_interval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                          GFConv2d(8, 8, 3, padding=1, radius=2), nn.ReLU(),
                          GFConv2d(8, 2, 1, radius=4, enabled=False))
    hub = MessageHub.get_instance('gf_quality_test')
    runner = SimpleNamespace(model=model, iter=1, message_hub=hub,
                             logger=MMLogger.get_instance('gf_quality_test'))
    hook = GradientQualityHook(interval=2)
    hook.before_train_iter(runner, 0)
    model(torch.randn(2, 3, 8, 8)).pow(2).sum().backward()
    hook.after_train_iter(runner, 0)
    scalars = hub.log_scalars
    cos = scalars['gf_quality/2/cos_grad_input'].current()
    assert 0 < cos < 1  # an approximation, positively aligned
    assert scalars['gf_quality/2/snr_grad_output'].current() > 0
    assert not any(k.startswith('gf_quality/4/') for k in scalars)  # disabled

    runner.iter = 2  # not a multiple of the interval (iter + 1 = 3)
    before = len(scalars)
    hook.before_train_iter(runner, 1)
    assert hook._recorder is None
    assert len(scalars) == before


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match='interval must be an int >= 1'):
        GradientQualityHook(interval=0)
