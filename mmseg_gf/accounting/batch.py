"""Random training batches for a segmentor's ``loss``: what the traces,
the budget's profile and the measurements run a step on."""
from typing import Sequence

import torch
import torch.nn.functional as F
from mmengine.structures import PixelData
from mmseg.structures import SegDataSample
from torch import nn

from ..models.segmentor import set_frozen_norms_eval

__all__ = ['random_batch', 'training_loss', 'summed_losses', 'model_device']


def random_batch(model: nn.Module,
                 input_size: Sequence[int],
                 batch: int = 1,
                 device='cpu',
                 seed: int = 0,
                 label_block: int = 1):
    """Random images and labels for ``model.loss``.

    Args:
        model: the segmentor (its ``decode_head.num_classes`` is used).
        input_size: ``(H, W)``.
        batch: images.
        device: where the tensors go.
        seed: of the generator (same seed, same batch).
        label_block: labels are constant on ``label_block`` pixel squares
            (1: independent per pixel; larger gives region-like maps).

    Returns:
        ``(inputs, data_samples)``; each sample has ``gt_sem_seg`` and the
        boundary map ``gt_edge_map`` that PIDNet's head trains on.
    """
    h, w = (int(v) for v in input_size)
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, 3, h, w, generator=gen).to(device)
    num_classes = int(getattr(model.decode_head, 'num_classes', 2))
    block = max(1, int(label_block))
    samples = []
    for _ in range(batch):
        coarse = torch.randint(0, num_classes,
                               (1, 1, -(-h // block), -(-w // block)),
                               generator=gen)
        labels = F.interpolate(coarse.float(), scale_factor=block,
                               mode='nearest')[0, :, :h, :w].long()
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=labels.to(device))
        sample.gt_edge_map = PixelData(data=_label_edges(labels).to(device))
        sample.set_metainfo(
            dict(img_shape=(h, w), pad_shape=(h, w), ori_shape=(h, w)))
        samples.append(sample)
    return inputs, samples


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: its first parameter's (or buffer's)
    device; the CPU for a model with neither."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device('cpu')


def _label_edges(labels: torch.Tensor) -> torch.Tensor:
    """1 where a pixel's label differs from its right or lower neighbour
    (the boundary map mmseg's ``GenerateEdge`` derives from the labels,
    one pixel wide), uint8 of the labels' shape."""
    edges = torch.zeros_like(labels, dtype=torch.uint8)
    edges[..., :, :-1] |= (labels[..., :, 1:] != labels[..., :, :-1])
    edges[..., :-1, :] |= (labels[..., 1:, :] != labels[..., :-1, :])
    return edges


def training_loss(model: nn.Module, inputs, data_samples):
    """``model.loss`` summed over its ``loss*`` terms, in training mode
    with frozen norms in eval mode (as GradFilterHook keeps them)."""
    model.train()
    set_frozen_norms_eval(model)
    return summed_losses(model.loss(inputs, data_samples))


def summed_losses(losses):
    """The ``loss*`` terms of ``model.loss``'s dict, summed (as
    mmengine's ``parse_losses`` sums them)."""
    return sum(v.sum() for k, v in losses.items() if 'loss' in k)
