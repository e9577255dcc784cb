"""Device discipline of a whole lean training step without a GPU: the
forward and backward of GF last 5 (r = 4, the lean region on: GF convs,
frozen norms, bit masks, the fused classifier + loss, the resized
cross-entropy) on the ``meta`` device, for a protocol model (a tiny
PSPNet-R18) and a real-time family (BiSeNetV2, auxiliary heads); and GF
last 20 of every layer kind (filtered Linears and attentions, patch-mean
GELUs, the lean LayerNorm / SDPA / DropPath) of tiny Segformer-B0 and
Swin-T UPerNet (tests/test_engine/test_lean_transformer_families.py).

Meta tensors have shapes, dtypes and a device but no data, so everything
that would break or stall on CUDA fails here (``tests/helpers/
device_discipline.py``): a tensor made on the CPU and mixed in, a value
read on the host (``.item()``, ``bool(t)``, data-dependent shapes such as
``nonzero`` or boolean-mask indexing), a copy to the CPU, an op with a CPU
kernel only. The ops' Functions on fake CUDA tensors:
``tests/test_ops/backend/test_device_discipline.py``.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.accounting.batch import random_batch, training_loss  # noqa: E402
from mmseg_gf.engine import apply_gradient_filter, select_layers  # noqa: E402
from mmseg_gf.engine.build import build_segmentor  # noqa: E402
from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from tests.helpers.engine_fixtures import (  # noqa: E402
    SMALL_BATCH, SMALL_SIZE, build_model)
from tests.test_engine.test_lean_transformer_families import (  # noqa
    SIZE as TOKEN_SIZE, tiny_cfg)
from tests.test_engine.test_realtime_families import (  # noqa: E402
    SIZE, family_cfg)


def _protocol_model():
    model = build_model('pspnet_r18')
    choices = select_layers(model, num_layers=5, radius=4,
                            input_size=SMALL_SIZE)
    apply_gradient_filter(model, choices, mode='gf', lean=True)
    return model, SMALL_SIZE


def _family_model():
    cfg = family_cfg('bisenetv2', SIZE)
    cfg.gradient_filter = dict(num_layers=5, radius=4, mode='gf', lean=True)
    return build_segmentor(cfg), (SIZE, SIZE)


def _transformer_model(name):
    cfg = tiny_cfg(name)
    cfg.gradient_filter = dict(num_layers=20, radius=4, mode='gf', lean=True,
                               layer_kinds=None)
    return build_segmentor(cfg), (TOKEN_SIZE, TOKEN_SIZE)


def _segformer_model():
    return _transformer_model('segformer_b0')


def _swin_model():
    return _transformer_model('swin_t')


@pytest.mark.parametrize(
    'make', [_protocol_model, _family_model, _segformer_model, _swin_model],
    ids=['pspnet_r18', 'bisenetv2', 'segformer_b0', 'swin_t'])
def test_lean_training_step_on_the_meta_device(make):
    torch.manual_seed(0)
    model, size = make()
    counts = lean_counts(model)
    assert counts['loss'] >= 1 and counts['activation'] > 0
    if make in (_segformer_model, _swin_model):
        assert counts['attention'] and counts['layer_norm'], counts
        assert counts['drop_path'] and counts['patch_mean_gelu'], counts
    model.to('meta')
    inputs, samples = random_batch(model, size, SMALL_BATCH, device='meta',
                                   label_block=4)
    loss = training_loss(model, inputs, samples)
    assert loss.device.type == 'meta'
    loss.backward()
    trained = {name: p for name, p in model.named_parameters()
               if p.requires_grad}
    assert trained
    for name, p in trained.items():
        assert p.grad is not None, name
        assert p.grad.device.type == 'meta' and p.grad.shape == p.shape
