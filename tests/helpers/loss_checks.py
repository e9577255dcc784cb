"""The lean losses' tests share these: a lean decode head's
``loss_by_feat`` against the plain one (the same loss values, float32 rtol
1e-5, and the same gradient w.r.t. the logits), labelled samples (given or
drawn at random), and PIDHead with OHEM, the head with the most loss terms
of its own."""
from typing import Optional, Sequence

import torch


def assert_same_loss_by_feat(plain, lean, logits0, samples):
    """Run both heads' ``loss_by_feat`` on copies of ``logits0``, backward
    the sum of their ``loss*`` outputs and compare."""
    results = []
    for head in (plain, lean):
        logits = logits0.clone().requires_grad_(True)
        out = head.loss_by_feat(logits * 1.0, samples)
        sum(v for k, v in out.items() if 'loss' in k).backward()
        results.append((out, logits.grad))
    (want, want_grad), (got, got_grad) = results
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5,
                               atol=1e-7 * float(want_grad.abs().max()))


def seg_samples(labels: Sequence[torch.Tensor],
                edges: Optional[Sequence[torch.Tensor]] = None) -> list:
    """One ``SegDataSample`` per ``1 x H x W`` label map (and edge map:
    PIDHead's boundary loss reads ``gt_edge_map``)."""
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    samples = []
    for i, label in enumerate(labels):
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=label)
        if edges is not None:
            sample.gt_edge_map = PixelData(data=edges[i])
        samples.append(sample)
    return samples


def random_samples(n: int, num_classes: int, size, seed: int,
                   ignored_rows: int = 0, blank_last: bool = False,
                   edges: bool = False) -> list:
    """``n`` samples of uniform random labels (``size`` = ``(H, W)``), one
    generator seeded ``seed`` drawing each image's label, then its edge
    map when ``edges``. ``ignored_rows``: the top rows of every label are
    ignored (255; a mean over labelled pixels differs from one over all);
    ``blank_last``: the last image has no label at all (a term with an
    empty selection)."""
    gen = torch.Generator().manual_seed(seed)
    labels, edge_maps = [], []
    for i in range(n):
        label = torch.randint(0, num_classes, (1, ) + tuple(size),
                              generator=gen)
        label[:, :ignored_rows] = 255
        if blank_last and i == n - 1:
            label[:] = 255
        labels.append(label)
        if edges:
            edge_maps.append(
                torch.randint(0, 2, (1, ) + tuple(size), generator=gen))
    return seg_samples(labels, edge_maps if edges else None)


#: PIDHead's class weights: the first ``num_classes`` of these (unequal,
#: so a weighting bug shows).
PID_CLASS_WEIGHTS = (0.8, 1.0, 1.2, 1.0, 0.9)


def pid_head(num_classes: int, min_kept: int,
             class_weight: Optional[Sequence[float]] = None):
    """A seeded PIDHead (8 -> 4 channels) with mmseg's four loss terms:
    cross-entropy, OHEM, the boundary loss, OHEM again; OHEM's class
    weights ``class_weight`` or :data:`PID_CLASS_WEIGHTS`."""
    from mmseg.registry import MODELS
    torch.manual_seed(0)
    if class_weight is None:
        class_weight = PID_CLASS_WEIGHTS[:num_classes]
    ohem = dict(type='OhemCrossEntropy', thres=0.9, min_kept=min_kept,
                class_weight=list(class_weight))
    return MODELS.build(dict(
        type='PIDHead', in_channels=8, channels=4, num_classes=num_classes,
        align_corners=True, loss_decode=[
            dict(type='CrossEntropyLoss', loss_weight=0.4), ohem,
            dict(type='BoundaryLoss', loss_weight=20.0), ohem]))
