"""How good are filtered gradients? SNR, cosine and the DC-energy ratio.

Definitions follow the paper (Eq. 8, Eq. 13, Proposition 1) as pinned down
in docs/gradient_filter.md#gradient-quality. Pure torch: no mmseg import."""

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.conv.function import gradient_filtered_conv2d
from ..patching import Hooks


def snr(target: Tensor, approx: Tensor) -> float:
    """Signal-to-noise ratio of ``approx`` as an estimate of ``target``.

    ``inf`` for an exact approximation; 1 for an all-zero one.
    """
    target, approx = target.double(), approx.double()
    noise = (target - approx).pow(2).sum().item()
    signal = target.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return signal / noise


def cosine(target: Tensor, approx: Tensor) -> float:
    """Cosine similarity of the two tensors, flattened."""
    return F.cosine_similarity(
        target.double().flatten(), approx.double().flatten(), dim=0).item()


def filtered_output_grad(grad_out: Tensor, radius: int) -> Tensor:
    """``g~_y`` at full resolution: every ``r x r`` patch set to its mean
    (border patches over their valid pixels)."""
    h, w = grad_out.shape[-2:]
    kernel = (min(radius, h), min(radius, w))
    means = F.avg_pool2d(grad_out, kernel, radius, ceil_mode=True)
    return means.repeat_interleave(radius, -2).repeat_interleave(
        radius, -1)[..., :h, :w]


@dataclass
class GradientQuality:
    """SNR and cosine of filtered vs exact gradients for one layer.

    ``*_grad_input_propagated``: the paper's ``g~_x`` of Proposition 1 (the
    filtered ``g~_y`` through the exact conv backward); ``*_grad_input``: the
    patch-constant input gradient training uses (Eq. 3)."""

    snr_grad_output: float
    snr_grad_input_propagated: float
    snr_grad_input: float
    snr_grad_weight: float
    cos_grad_output: float
    cos_grad_input: float
    cos_grad_weight: float

    @property
    def proposition1_holds(self) -> bool:
        """Proposition 1: ``SNR(g~_x) >= SNR(g~_y)``."""
        return self.snr_grad_input_propagated >= self.snr_grad_output


def layer_gradient_quality(conv: nn.Conv2d, x: Tensor, grad_out: Tensor,
                           radius: int) -> GradientQuality:
    """Compare the filtered and exact gradients of one conv at ``x``.

    Args:
        conv: the layer (its geometry and weight are used; it is not run).
        x: the layer's input for a batch.
        grad_out: ``dL/dy`` arriving at the layer's output for that batch.
        radius: the patch size ``r``.
    """
    weight = conv.weight.detach()
    args = (conv.stride, conv.padding, conv.dilation, conv.groups)

    def grads(fn, gy=grad_out):
        xi = x.detach().requires_grad_()
        wi = weight.clone().requires_grad_()
        fn(xi, wi).backward(gy)
        return xi.grad, wi.grad

    def exact(xi, wi):
        return F.conv2d(xi, wi, None, *args)

    exact_x, exact_w = grads(exact)
    gf_x, gf_w = grads(lambda xi, wi: gradient_filtered_conv2d(
        xi, wi, None, *args, radius=radius))
    gy_f = filtered_output_grad(grad_out, radius)
    propagated_x, _ = grads(exact, gy_f)
    return GradientQuality(
        snr_grad_output=snr(grad_out, gy_f),
        snr_grad_input_propagated=snr(exact_x, propagated_x),
        snr_grad_input=snr(exact_x, gf_x),
        snr_grad_weight=snr(exact_w, gf_w),
        cos_grad_output=cosine(grad_out, gy_f),
        cos_grad_input=cosine(exact_x, gf_x),
        cos_grad_weight=cosine(exact_w, gf_w))


def _taps(weight: Tensor) -> int:
    """Taps of a ``C_out x C_in/groups x k...`` kernel."""
    return math.prod(weight.shape[2:])


def dc_energy_ratios(weight: Tensor) -> Tensor:
    """Eq. 13 for every kernel slice of a conv weight with more than one tap.

    Returns a flat tensor of ratios, one per (out, in) slice."""
    if weight.dim() < 3 or _taps(weight) <= 1:
        raise ValueError('the DC energy ratio needs a kernel larger than 1x1')
    axes = tuple(range(2, weight.dim()))
    spectrum = torch.fft.fftn(weight.detach().double(),
                              dim=axes).abs().pow(2)
    flat = spectrum.flatten(2)
    dc = flat[..., 0]
    ac_max = flat[..., 1:].amax(dim=-1)
    return (dc / ac_max.clamp_min(torch.finfo(torch.float64).tiny)).flatten()


def model_dc_energy_ratio(
        kernels: Iterable[Tuple[str, Tensor]]) -> Dict[str, float]:
    """Per-layer mean of Eq. 13 over slices, and the network mean.

    ``kernels``: ``(name, weight)`` of a network's layers with a kernel. The
    ``'mean'`` key averages the per-layer means (of kernels of more than one
    tap), so that a few huge layers do not dominate the paper's one number
    per network (Table 5)."""
    per_layer = {}
    for name, weight in kernels:
        if _taps(weight) > 1:
            per_layer[name] = dc_energy_ratios(weight).mean().item()
    if not per_layer:
        raise ValueError('no conv with a kernel larger than 1x1 found')
    per_layer['mean'] = sum(per_layer.values()) / len(per_layer)
    return per_layer


def capture_layer_io(layers: List[Tuple[str, nn.Module]]):
    """Context manager recording each layer's ``(x, g_y)`` in
    ``records[name]`` over one forward + backward."""
    return _LayerRecorder(layers)


class _LayerRecorder:

    def __init__(self, layers):
        self.layers = layers
        self.records: Dict[str, List[Tensor]] = {}
        self._hooks = Hooks()

    def __enter__(self):
        for name, module in self.layers:
            self._hooks.add(
                module.register_forward_hook(self._make_hook(name)))
        return self.records

    def _make_hook(self, name):

        def hook(module, inputs, output):
            record = [inputs[0].detach(), None]
            self.records[name] = record
            if output.requires_grad:

                def keep(grad):
                    record[1] = grad.detach()

                output.register_hook(keep)

        return hook

    def __exit__(self, *exc):
        self._hooks.remove()
        return False
