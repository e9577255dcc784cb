"""mmseg_gf.accounting.batch: the random batches every trace and
measurement steps on, and the loss they differentiate, against mmengine's
own sum of the loss terms and a pixel-by-pixel edge map."""
import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.model import BaseModel  # noqa: E402

from mmseg_gf.accounting.batch import random_batch, summed_losses  # noqa
from tests.helpers.engine_fixtures import build_model  # noqa: E402


class _Head(torch.nn.Module):
    num_classes = 4


class _Segmentor(torch.nn.Module):
    decode_head = _Head()


def test_same_seed_same_batch_and_labels_in_range():
    model = _Segmentor()
    inputs, samples = random_batch(model, (6, 10), 3, seed=5)
    again, again_samples = random_batch(model, (6, 10), 3, seed=5)
    other, _ = random_batch(model, (6, 10), 3, seed=6)
    assert inputs.shape == (3, 3, 6, 10)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    for sample, twin in zip(samples, again_samples):
        labels = sample.gt_sem_seg.data
        assert labels.shape == (1, 6, 10)
        assert torch.equal(labels, twin.gt_sem_seg.data)
        assert 0 <= int(labels.min()) and int(labels.max()) < 4
        assert sample.metainfo['img_shape'] == (6, 10)


def test_label_blocks_and_their_edges():
    """Labels constant on 3x3 squares (clipped at the border); the edge map
    is 1 where a pixel's right or lower neighbour differs."""
    _, samples = random_batch(_Segmentor(), (7, 8), 2, label_block=3)
    for sample in samples:
        labels = sample.gt_sem_seg.data[0]
        for i in range(7):
            for j in range(8):
                assert labels[i, j] == labels[i - i % 3, j - j % 3]
        edges = sample.gt_edge_map.data[0]
        for i in range(7):
            for j in range(8):
                right = j + 1 < 8 and labels[i, j + 1] != labels[i, j]
                down = i + 1 < 7 and labels[i + 1, j] != labels[i, j]
                assert edges[i, j] == int(right or down), (i, j)


def test_summed_losses_is_mmengines_sum_of_the_loss_terms():
    model = build_model('fcn_r18')
    inputs, samples = random_batch(model, (32, 32), 2)
    model.train()
    losses = model.loss(inputs, samples)
    assert any('loss' not in key for key in losses)  # the accuracy
    expected, _ = BaseModel.parse_losses(model, losses)
    torch.testing.assert_close(summed_losses(losses), expected)
