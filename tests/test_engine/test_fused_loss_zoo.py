"""The lean step (classifier fused with the loss) against ``lean=False`` on
mmseg's own configs of the real-time families whose heads return tuples or
carry their own losses (tiny inputs, the shrunk models of
``test_zoo_sweep``): the same losses and every trained parameter's
gradient (float32, rtol 1e-5)."""
import copy

import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402

from mmseg_gf.engine import rewrite_config  # noqa: E402
from mmseg_gf.models import lean_head  # noqa: E402
from mmseg_gf.models.lean_head import fusion_blocker  # noqa: E402
from tests.helpers.lean_steps import training_step  # noqa: E402
from tests.test_engine.test_zoo_sweep import (CASES, build,  # noqa: E402
                                              data_batch, load_model_cfg,
                                              perturb)

FAMILIES = ('PIDHead', 'DDRHead', 'SegformerHead', 'DAHead', 'EncHead',
            'FCNHead + STDCHead aux (STDC)', 'FCNHead on BiSeNetV1')


def _model(case, lean, state=None):
    cfg = Config(dict(model=load_model_cfg(case),
                      crop_size=(case.size, case.size),
                      gradient_filter=dict(num_layers=case.num_layers,
                                           radius=2, lean=lean)))
    rewrite_config(cfg)
    model = build(cfg.model)
    if state is not None:
        model.load_state_dict(state)
    return model


def _preprocessed_step(model, data):
    """:func:`training_step` on ``data`` through the model's data
    preprocessor: every output detached, the gradients."""
    batch = model.data_preprocessor(copy.deepcopy(data), True)
    losses, grads = training_step(model, batch['inputs'],
                                  batch['data_samples'], seed=3)
    return {k: v.detach() for k, v in losses.items()}, grads


#: Heads whose own loss_by_feat has a lean reimplementation
#: (mmseg_gf.models.lean_ohem): autograd over mmseg's loss must not run.
OWN_LEAN_LOSS = ('PIDHead', 'DDRHead')


def _no_autograd_loss(*args, **kwargs):
    raise AssertionError('mmseg\'s loss_by_feat ran under autograd')


@pytest.mark.parametrize('family', FAMILIES)
def test_fused_step_equals_plain_step(family, monkeypatch):
    case = next(c for c in CASES if c.family == family)
    if family in OWN_LEAN_LOSS:
        monkeypatch.setattr(lean_head, '_logit_gradients', _no_autograd_loss)
    torch.manual_seed(0)
    plain = _model(case, lean=False)
    perturb(plain)
    lean = _model(case, lean=True, state=plain.state_dict())
    data = data_batch(plain, case.size)
    want, want_grads = _preprocessed_step(plain, data)
    got, got_grads = _preprocessed_step(lean, data)
    assert fusion_blocker(lean.decode_head) is None  # it stayed fused
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0,
                                   msg=lambda m: f'{key}: {m}')
    assert want_grads.keys() == got_grads.keys()
    # gradients that are zero but for rounding (DANet's key-projection
    # bias: a softmax ignores a shift) compare at the model's scale
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5,
                                   atol=1e-6 * max(float(g.abs().max()),
                                                   1e-3 * scale),
                                   msg=lambda m: f'{name}: {m}')
