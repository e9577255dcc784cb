"""mmseg_gf.ops.lean.kept_sources: which tensor a gradient kept by a lean loss's
custom Function was taken from, as the saved-tensor hooks see it."""
import gc

import pytest
import torch
from torch import nn

from mmseg_gf.ops.loss.fused_classifier import (ConvSpec,
                                                FusedClassifierLossFunction)
from mmseg_gf.ops.loss.gradients import LogitGradients
from mmseg_gf.ops.lean.kept_sources import note_sources, recording, sources_of


def test_sources_are_weak_paired_and_recorded_only_when_asked():
    kept, source = torch.zeros(3), torch.ones(3)
    note_sources([kept], [source])
    assert sources_of(kept) == []  # a training step records nothing
    with recording():
        note_sources([kept], [source])
    assert sources_of(kept)[0] is source
    assert sources_of(source) == []
    del source
    gc.collect()
    assert sources_of(kept) == []  # the record keeps no source alive
    with pytest.raises(ValueError, match='2 kept tensors, 1 sources'):
        note_sources([kept, kept], [kept])


def test_fused_classifier_names_the_source_of_everything_it_keeps():
    """g_z comes from the classifier's input, g_W and g_b from its
    Parameters, the other logits' gradients from those logits."""
    conv = nn.Conv2d(4, 3, 1)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    other = torch.randn(2, 3, 5, 5, requires_grad=True)

    def gradients(z, o):
        loss = LogitGradients({'loss': (z.sum() + o.sum()).detach()})
        loss.mix['loss'] = [(0, 1.0)]
        loss.bases.append(torch.ones_like(z))
        loss.others['loss'] = (torch.ones_like(o), )
        return loss

    packed = []

    def pack(t):
        packed.append((t, [id(s) for s in sources_of(t)]))
        return t

    with recording(), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        with torch.no_grad():
            z = conv(x)
        keys = []
        FusedClassifierLossFunction.apply(x, conv.weight, conv.bias, z, None,
                                          ConvSpec.of(conv), gradients, keys,
                                          other)
    kept = sorted((tuple(t.shape), s) for t, s in packed
                  if not isinstance(t, nn.Parameter))
    assert kept == sorted([((2, 3, 5, 5), [id(x)]),
                           ((2, 3, 5, 5), [id(other)]),
                           ((3, 4, 1, 1), [id(conv.weight)]),
                           ((3, ), [id(conv.bias)])])
