"""Filtered Linears inside blocks built with ``with_cp=True``.

mmseg's Swin, MiT (Segformer) and ViT (DeiT) layers checkpoint their inner
forward; the backward recomputes it without the blocks' hooks. The
bindings checkpoint those blocks themselves, setting the grids of the call
being recomputed (``CheckpointWithGrids`` of
``mmseg_gf.models.token_grids.recompute``).
Each family as in ``test_token_grids.py`` (shrunk, float64, every layer on
a grid filtered at r = 2, every parameter requiring a gradient, so every
block's input does and every block is checkpointed): the gradients with
``with_cp=True`` equal those with ``with_cp=False``, no layer falls back to
the exact backward, and the recompute did run.
"""
import copy
import warnings

import pytest
import torch

pytest.importorskip('mmseg')

from mmseg.models.backbones.mit import \
    TransformerEncoderLayer as MiTLayer  # noqa: E402
from mmseg.models.backbones.swin import SwinBlock  # noqa: E402
from mmseg.models.backbones.vit import \
    TransformerEncoderLayer as ViTLayer  # noqa: E402

from mmseg_gf.models.gf_conv import GFExactBackwardWarning  # noqa: E402
from mmseg_gf.models.token_grids import (  # noqa: E402
    install_token_grids, recompute, uninstall_token_grids)
from tests.helpers.token_families import tiny_model  # noqa: E402
from tests.test_models.test_token_grids import (  # noqa: E402
    filtered_module, plain_model_and_grad, swapped_gradients)

pytestmark = pytest.mark.usefixtures('one_thread')


def _filtered_gradients(model, inputs, grad):
    return swapped_gradients(model, inputs, grad,
                             lambda m, site: filtered_module(m, site, 2))


@pytest.mark.parametrize('name', ['swin_t', 'segformer_b0', 'deit_s'])
def test_checkpointed_blocks_recompute_with_their_grids(name, monkeypatch):
    inputs, plain, grad = plain_model_and_grad(name)
    want = _filtered_gradients(plain, inputs, grad)
    model = tiny_model(name, with_cp=True)
    blocks = [m for m in model.modules()
              if isinstance(m, (SwinBlock, MiTLayer, ViTLayer))]
    assert blocks and all(m.with_cp for m in blocks)
    recomputed = []

    def counting(function, *args, **kwargs):
        def run(*a):
            recomputed.append(torch.is_grad_enabled())
            return function(*a)
        return torch.utils.checkpoint.checkpoint(run, *args, **kwargs)

    monkeypatch.setattr(recompute, 'checkpoint', counting, raising=False)
    got = _filtered_gradients(model, inputs, grad)
    # each block: a forward without autograd, a recompute with it
    assert recomputed.count(False) == len(blocks)
    assert recomputed.count(True) == len(blocks)
    assert got.keys() == want.keys()
    for key in want:
        scale = float(want[key].abs().max()) or 1.0
        torch.testing.assert_close(got[key], want[key], rtol=1e-9,
                                   atol=1e-9 * scale, msg=key)
    assert all(m.with_cp for m in blocks)
    assert all('forward' not in m.__dict__ for m in blocks)


def test_uninstalling_puts_back_each_blocks_own_forward():
    """The recompute is an instance override (mmseg_gf.patching): the
    bindings' removal puts back what each block held (an instance
    ``forward`` set before survives), and a copy of the model removes its
    own blocks' forwards, not the original's."""
    model = tiny_model('swin_t', with_cp=True)
    blocks = [m for m in model.modules() if isinstance(m, SwinBlock)]
    earlier = blocks[0].forward  # a bound method as an instance attribute
    blocks[0].forward = earlier
    install_token_grids(model)
    assert all(isinstance(vars(b)['forward'], recompute.CheckpointWithGrids)
               for b in blocks)
    twin = copy.deepcopy(model)
    uninstall_token_grids(twin)
    twin_blocks = [m for m in twin.modules() if isinstance(m, SwinBlock)]
    assert all('forward' not in vars(b) for b in twin_blocks[1:])
    assert not isinstance(vars(twin_blocks[0])['forward'],
                          recompute.CheckpointWithGrids)
    assert all(isinstance(vars(b)['forward'], recompute.CheckpointWithGrids)
               for b in blocks)
    uninstall_token_grids(model)
    assert vars(blocks[0])['forward'] is earlier
    assert all('forward' not in vars(b) for b in blocks[1:])


def test_built_swin_with_cp_trains_as_without(monkeypatch):
    """The whole path (selection, surgery, lean region, GELU rule) on Swin
    UPerNet built with ``with_cp=True``: the last 20 layers' gradients of
    one training step equal those built with ``with_cp=False``, with no
    fallback to the exact backward."""
    from mmengine.registry import init_default_scope

    from mmseg_gf.accounting.batch import random_batch
    from mmseg_gf.engine.config import build_grad_filter_model
    from mmseg_gf.models.segmentor import set_frozen_norms_eval
    from tests.test_engine.test_lean_transformer_families import tiny_cfg
    init_default_scope('mmseg')
    checkpointed = []

    def counting(function, *args, **kwargs):
        checkpointed.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(recompute, 'checkpoint', counting, raising=False)
    grads, plain_state = {}, None
    for with_cp in (False, True):
        model_cfg = tiny_cfg('swin_t').model
        model_cfg.backbone.update(with_cp=with_cp, drop_path_rate=0.0)
        torch.manual_seed(0)
        model = build_grad_filter_model(model_cfg, num_layers=20, radius=4,
                                        input_size=(64, 64))
        if with_cp:
            model.load_state_dict(plain_state)
        plain_state = model.state_dict()
        batch = random_batch(model, (64, 64), 2, label_block=4)
        model.train()
        set_frozen_norms_eval(model)
        with warnings.catch_warnings():
            warnings.simplefilter('error', GFExactBackwardWarning)
            torch.manual_seed(3)
            losses = model.loss(*batch)
            sum(v for k, v in losses.items() if 'loss' in k).backward()
        grads[with_cp] = {n: p.grad for n, p in model.named_parameters()
                          if p.requires_grad}
    assert any('.blocks.' in n for n in grads[True]) and checkpointed
    assert grads[True].keys() == grads[False].keys()
    for key, want in grads[False].items():
        torch.testing.assert_close(grads[True][key], want, rtol=1e-4,
                                   atol=1e-6, msg=key)
