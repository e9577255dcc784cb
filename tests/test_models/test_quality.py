"""Gradient-quality measures (SNR, cosine, DC energy) on known cases."""
import math

import pytest
import torch
from torch import nn

from mmseg_gf.models.gradient_quality import (capture_layer_io, cosine,
                                              dc_energy_ratios,
                                              filtered_output_grad,
                                              layer_gradient_quality,
                                              model_dc_energy_ratio, snr)


def test_snr_limits_and_value():
    t = torch.randn(3, 4, 5)
    assert snr(t, t) == math.inf
    assert snr(t, torch.zeros_like(t)) == pytest.approx(1.0)
    # noise of a tenth of the signal in every element: SNR = 100
    assert snr(t, t * 1.1) == pytest.approx(100.0)
    assert cosine(t, 2 * t) == pytest.approx(1.0)
    assert cosine(t, -t) == pytest.approx(-1.0)


def test_filtered_output_grad_is_patch_mean_with_partial_borders():
    g = torch.arange(25.).reshape(1, 1, 5, 5)
    f = filtered_output_grad(g, 4)
    assert f[0, 0, 0, 0] == g[0, 0, :4, :4].mean()
    assert f[0, 0, 4, 4] == g[0, 0, 4, 4]
    assert f[0, 0, 0, 4] == g[0, 0, :4, 4].mean()


def test_patch_constant_output_grad_and_exact_1x1_layer():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 1)
    x = torch.randn(2, 3, 8, 8)
    g = torch.randn(2, 4, 2, 2).repeat_interleave(4, 2).repeat_interleave(4, 3)
    q = layer_gradient_quality(conv, x, g, radius=4)
    # g_y constant on patches: the filter changes nothing, 1x1 exact too.
    assert q.snr_grad_output > 1e12 and q.cos_grad_output == pytest.approx(1)
    assert q.snr_grad_input > 1e12 and q.snr_grad_weight > 1e12


@pytest.mark.parametrize('channels', [1, 8])
def test_proposition1_for_a_dc_dominated_kernel(channels):
    torch.manual_seed(0)
    conv = nn.Conv2d(channels, channels, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(1 + 0.1 * torch.randn_like(conv.weight))
    assert dc_energy_ratios(conv.weight).min() > 1
    x = torch.randn(2, channels, 16, 16)
    g = torch.randn(2, channels, 16, 16)
    q = layer_gradient_quality(conv, x, g, radius=2)
    assert q.proposition1_holds
    assert 0 < q.cos_grad_output < 1


def test_dc_energy_ratio_known_kernels():
    delta = torch.zeros(1, 1, 3, 3)
    delta[..., 1, 1] = 1  # flat spectrum: DC equals every AC component
    assert dc_energy_ratios(delta).item() == pytest.approx(1.0)
    smooth = torch.tensor([[1., 2., 1.], [2., 4., 2.], [1., 2., 1.]])
    # DFT of the binomial kernel: DC 16, largest AC |(1+2w+w^2)|*4 = 4
    assert dc_energy_ratios(smooth[None, None]).item() == pytest.approx(16.0)
    # the kernels of more than one tap count; a 1-D kernel's DFT is 1-D:
    # (1, 2, 1) has DC 4 and |1 + 2w + w^2| = |w| = 1 at the other two
    kernels = [('0', smooth[None, None]), ('1', torch.ones(1, 1, 1, 1)),
               ('2', torch.tensor([[[1., 2., 1.]]])),
               ('3', torch.ones(1, 1, 1))]
    ratios = model_dc_energy_ratio(kernels)
    assert ratios == pytest.approx({'0': 16, '2': 16, 'mean': 16})
    with pytest.raises(ValueError, match='larger than 1x1'):
        dc_energy_ratios(torch.ones(2, 2, 1, 1))


def test_capture_layer_io_records_input_and_output_grad():
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(3, 1, 1))
    x = torch.randn(2, 2, 6, 6)
    with capture_layer_io([('c', model[2])]) as records:
        model(x).sum().backward()
    inp, grad = records['c']
    assert inp.shape == (2, 3, 6, 6)
    torch.testing.assert_close(grad, torch.ones(2, 1, 6, 6))


def test_saved_bytes_filtered_vs_vanilla_match_analytic_ratio():
    from mmseg_gf import GFConv2d
    from mmseg_gf.accounting.measured import saved_tensor_bytes
    conv = nn.Conv2d(8, 8, 3, padding=1)
    gf = GFConv2d.from_conv(conv, radius=4)
    x = torch.randn(2, 8, 32, 32)
    vanilla = saved_tensor_bytes(lambda: conv(x))
    filtered = saved_tensor_bytes(lambda: gf(x))
    assert vanilla == x.numel() * 4  # x itself; the weight is a Parameter
    assert filtered == x.numel() * 4 // 16  # patch sums: 1/r^2
