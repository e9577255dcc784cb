""""The last N" counts only convs that a gradient of the output reaches.

A toy decode head (registered for the test) has one conv of every kind the
trace must tell apart: used under ``torch.no_grad`` and frozen (as EMANet's
``ema_mid_conv``), detached, feeding only a training-only side classifier
(as DANet's ``pam_conv_seg``), followed by an in-place ReLU without a norm,
and run twice (shared).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmseg_gf.engine import select_layers, trace_layers
from tests.helpers.engine_fixtures import EXPECTED, model_cfg


def _register_head():
    from mmseg.models.decode_heads.decode_head import BaseDecodeHead
    from mmseg.registry import MODELS

    class ReachToyHead(BaseDecodeHead):

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            c = self.channels
            self.pre = nn.Conv2d(self.in_channels, c, 3, padding=1)
            self.frozen = nn.Conv2d(c, c, 1)
            for p in self.frozen.parameters():
                p.requires_grad = False
            self.detached = nn.Conv2d(c, c, 1)
            self.shared = nn.Conv2d(c, c, 1)
            self.side = nn.Conv2d(c, c, 1)
            self.side_seg = nn.Conv2d(c, self.out_channels, 1)
            self.post = nn.Conv2d(c, c, 1)

        def forward(self, inputs):
            x = self.pre(self._transform_inputs(inputs))
            with torch.no_grad():
                gate = torch.sigmoid(self.frozen(x))
            y = x * gate + self.detached(x).detach()
            y = self.shared(self.shared(y))
            side = self.side_seg(self.side(x))
            y = F.relu(self.post(y), inplace=True)
            return self.cls_seg(y), side

        def predict(self, inputs, batch_img_metas, test_cfg):
            return self.predict_by_feat(self.forward(inputs)[0],
                                        batch_img_metas)

        def loss_by_feat(self, seg_logits, batch_data_samples):
            losses = super().loss_by_feat(seg_logits[0], batch_data_samples)
            side = super().loss_by_feat(seg_logits[1], batch_data_samples)
            losses['loss_side'] = side['loss_ce']
            return losses

    MODELS.register_module(name='ReachToyHead', module=ReachToyHead,
                           force=True)


def build_toy(**backbone):
    from mmengine.config import ConfigDict
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    _register_head()
    cfg = model_cfg('pspnet_r18')
    head = cfg['decode_head']
    cfg['decode_head'] = dict(type='ReachToyHead', in_channels=512,
                              in_index=3, channels=16, num_classes=3,
                              dropout_ratio=0.0, norm_cfg=head['norm_cfg'],
                              align_corners=False,
                              loss_decode=head['loss_decode'])
    cfg['backbone'].update(backbone)
    torch.manual_seed(0)
    return MODELS.build(ConfigDict(cfg))


@pytest.fixture(scope='module')
def toy():
    return build_toy()


def test_trace_marks_what_the_output_depends_on(toy):
    records = {r.path: r for r in trace_layers(toy, (64, 64))}
    feeds = {p[len('decode_head.'):]: (r.feeds_output, r.feeds_heads)
             for p, r in records.items() if p.startswith('decode_head.')}
    assert feeds == {
        'pre': (True, True),
        'frozen': (False, False),
        'detached': (False, False),
        'shared': (True, True),
        'side': (False, True),
        'side_seg': (False, True),
        'post': (True, True),
        'conv_seg': (True, True),
    }
    assert all(r.feeds_output for p, r in records.items()
               if p.startswith('backbone.'))
    # the trace leaves requires_grad as it found it
    assert not any(p.requires_grad for p in toy.decode_head.frozen.parameters())
    assert all(p.requires_grad for p in toy.decode_head.pre.parameters())


def test_last_n_skips_unreached_convs(toy):
    choices = select_layers(toy, num_layers=4, input_size=(64, 64))
    assert [c.path for c in choices] == [
        'backbone.layer4.1.conv2', 'decode_head.pre', 'decode_head.shared',
        'decode_head.post'
    ]
    # every conv that runs, minus 4 unreached, minus the classifier
    runs = len(trace_layers(toy, (64, 64)))
    with pytest.raises(ValueError) as err:
        select_layers(toy, num_layers=runs, input_size=(64, 64))
    msg = str(err.value)
    assert f'[1, {runs - 5}]' in msg
    assert "no gradient of the output reaches them: ['decode_head.frozen', " \
        "'decode_head.detached', 'decode_head.side', " \
        "'decode_head.side_seg']" in msg


def test_named_layers_skip_or_refuse_unreachable(toy):
    head = select_layers(toy, layers=['decode_head'], input_size=(64, 64))
    assert [c.path for c in head] == [
        'decode_head.pre', 'decode_head.shared', 'decode_head.side',
        'decode_head.side_seg', 'decode_head.post'
    ]
    with pytest.raises(ValueError,
                       match="no loss gradient reaches 'decode_head.frozen'"):
        select_layers(toy, layers=['decode_head.frozen'],
                      input_size=(64, 64))


def test_selected_convs_get_gradients(toy):
    import copy

    from mmseg_gf.engine import apply_gradient_filter, set_frozen_norms_eval
    model = copy.deepcopy(toy)
    choices = select_layers(model, num_layers=4, radius=2,
                            input_size=(64, 64))
    apply_gradient_filter(model, choices)
    model.train()
    set_frozen_norms_eval(model)
    x = torch.randn(2, 3, 64, 64)
    out, side = model.decode_head.forward(model.extract_feat(x))
    (out.square().mean() + side.square().mean()).backward()
    for c in choices:
        g = model.get_submodule(c.path).weight.grad
        assert g is not None and bool(g.abs().sum() > 0), c.path
    trained = {c.path for c in choices} | {'decode_head.conv_seg'}
    got = {n.rsplit('.', 1)[0] for n, p in model.named_parameters()
           if p.grad is not None}
    assert got == trained


def test_with_cp_does_not_hide_convs():
    """A reentrant activation checkpoint runs its forward without autograd;
    the trace switches ``with_cp`` off and restores it."""
    model = build_toy(with_cp=True)
    blocks = [m for m in model.modules() if hasattr(m, 'with_cp')]
    assert blocks and all(m.with_cp for m in blocks)
    choices = select_layers(model, num_layers=8, input_size=(64, 64))
    assert [c.path for c in choices][:5] == EXPECTED['pspnet_r18'][10][:5]
    assert all(m.with_cp for m in blocks)


def test_grad_trace_records_are_retraced(toy):
    records = trace_layers(toy, (64, 64), grad=True)
    assert all(r.feeds_output is None for r in records)
    by_path = {r.path: r for r in records}
    assert by_path['decode_head.pre'].input_requires_grad
    choices = select_layers(toy, num_layers=2, input_size=(64, 64),
                            records=records)
    assert [c.path for c in choices] == ['decode_head.shared',
                                         'decode_head.post']
