"""What no rule covers is measured, not counted as zero.

A tiny segmentor with an SE gate (``x * sigmoid(conv(pool(x)))``, mmseg's
``SELayer``), GELU (counted by its rule), a frozen PReLU, mmcv's HSigmoid and a max-pool stem: the
step trace's analytic + measured total equals autograd's saved bytes of a
real step at batch 2, the unmodelled kinds are named with their bytes, and
the budget's profile predicts every last-N setting's saved bytes. Then the
selection reaching the stem of PSPNet-R18 (max-pool included).
"""
import pytest
import torch
from torch import nn

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402
from mmengine.model import BaseModule  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402
from mmcv.cnn import ConvModule  # noqa: E402
from mmseg.models.utils import SELayer  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

from mmseg_gf.accounting.budget import choose_by_budget  # noqa: E402
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.engine.budget import profile_segmentor  # noqa: E402
from mmseg_gf.analysis.budget_sweep import measured_step_peak  # noqa: E402
from tests.helpers.engine_fixtures import (  # noqa: E402
    filtered_copy, step_saved_bytes)
from tests.helpers.tiny_segmentors import (  # noqa: E402
    BN, fcn_head, tiny_segmentor)

SIZE = (32, 32)
BATCH = 2


class LinearGate(nn.Module):
    """CGNet's context gate, ``x * sigmoid(mean(x) @ W^T)``, all in its own
    code: the product with the frozen weight saves the weight's transposed
    view (the same bytes at any batch)."""

    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, channels) * 0.1)

    def forward(self, x):
        gate = torch.sigmoid(x.mean((2, 3)) @ self.weight.t())
        return x * gate[:, :, None, None]


@MODELS.register_module(force=True)
class GatedTestBackbone(BaseModule):
    """stem conv -> max-pool -> conv + frozen PReLU -> SE gate (Sigmoid)
    -> linear gate -> conv + GELU -> conv + mmcv's HSigmoid (then a
    decode head and a frozen auxiliary head)."""

    def __init__(self):
        super().__init__()
        self.stem = ConvModule(3, 8, 3, 2, 1, norm_cfg=BN)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv1 = ConvModule(8, 16, 3, 1, 1, norm_cfg=BN,
                                act_cfg=dict(type='PReLU', num_parameters=16))
        self.se = SELayer(16, ratio=4, act_cfg=(dict(type='ReLU'),
                                                dict(type='Sigmoid')))
        self.gate = LinearGate(16)
        self.conv2 = ConvModule(16, 16, 3, 1, 1, norm_cfg=BN,
                                act_cfg=dict(type='GELU'))
        self.conv3 = ConvModule(16, 16, 1, norm_cfg=BN,
                                act_cfg=dict(type='HSigmoid'))

    def forward(self, x):
        x = self.conv1(self.pool(self.stem(x)))
        return (self.conv3(self.conv2(self.gate(self.se(x)))), )


def _gated_model():
    # the auxiliary head is frozen, in the gradient path: lean frozen
    # convs, a lean loss
    return tiny_segmentor('GatedTestBackbone', SIZE, fcn_head(16, 8),
                          fcn_head(16, 8, loss_weight=0.4))


def test_trace_measures_the_se_gate_and_matches_a_real_step():
    base = _gated_model()
    model = filtered_copy(base, 7, 2, SIZE)  # every conv but the classifier
    for m in model.modules():
        if isinstance(m, nn.PReLU):
            assert not m.weight.requires_grad
    counted = trace_step_saved_bytes(model, SIZE)
    assert counted.total(BATCH) == step_saved_bytes(model, SIZE, BATCH)
    unmodelled = counted.unmodelled_bytes(BATCH)
    # Sigmoid keeps its output, the gate products x and the gate: 16
    # channels at 8x8 (the gates 16 x 1 x 1), float32, batch 2
    assert unmodelled['Sigmoid'] == BATCH * 16 * 4
    assert unmodelled['SELayer (functional)'] == BATCH * 16 * 8 * 8 * 4
    # x, the gate, and the weight's view (once, whatever the batch)
    assert unmodelled['LinearGate'] == \
        BATCH * 16 * (8 * 8 + 1) * 4 + 16 * 16 * 4
    assert set(unmodelled) == {'Sigmoid', 'SELayer (functional)',
                               'LinearGate'}
    # the lean kinds are counted by their rules, not measured; so is GELU
    # (its input, kept_transformer): 16 channels at 8x8
    by_category = counted.by_category(BATCH)
    assert by_category['pool'] == BATCH * 8 * 8 * 8
    gelu = [i for i in counted.items if i.path == 'backbone.conv2.activate']
    assert [i.nbytes(BATCH) for i in gelu] == [BATCH * 16 * 8 * 8 * 4]
    assert by_category['unmodelled'] == sum(unmodelled.values())
    line = counted.summary(BATCH)
    assert "unmodelled: " in line and "Sigmoid 0.00 MiB measured" in line


def test_profile_predicts_every_setting_with_measured_bytes():
    """Every last-N setting, the measured storages counted only when the
    operations saving them are recorded: the profile's prediction equals
    autograd's saved bytes of the model built that way."""
    base = _gated_model()
    profile = profile_segmentor(base, SIZE)
    assert profile.max_layers == 7
    for n in range(1, profile.max_layers + 1):
        predicted = profile.cost(n, 2, BATCH).saved_bytes
        model = filtered_copy(base, n, 2, SIZE)
        assert predicted == step_saved_bytes(model, SIZE, BATCH), n
    assert 'backbone.se' in profile.unmodelled(profile.max_layers)


def _stock_pspnet_r18():
    """configs/_base_/models/pspnet_r18-d8.py as it is (BN, no auxiliary
    head, random init) with a small data preprocessor size."""
    init_default_scope('mmseg')
    cfg = Config.fromfile('configs/_base_/models/pspnet_r18-d8.py')
    cfg.model.data_preprocessor.size = STEM_SIZE
    cfg.model.decode_head.num_classes = 3
    torch.manual_seed(0)
    return MODELS.build(cfg.model)


STEM_SIZE = (128, 128)


def test_budget_reaching_the_stem_predicts_kept_bytes_and_peak():
    """A saved-bytes budget that chooses every conv, stem and its max-pool
    included: the predicted kept bytes and step peak are within 10% of the
    measured ones (kept bytes exactly: the max-pool keeps its window
    offsets by rule)."""
    base = _stock_pspnet_r18()
    profile = profile_segmentor(base, STEM_SIZE, timeline=True)
    limit = profile.cost(profile.max_layers, 8, BATCH).saved_mib * 1.001
    choice = choose_by_budget(profile, dict(saved_mib=limit, radii=[8]),
                              BATCH)
    assert choice.num_layers == profile.max_layers
    assert 'backbone.stem.0' in choice.radius
    model = filtered_copy(base, choice.num_layers, choice.radius, STEM_SIZE)
    measured = step_saved_bytes(model, STEM_SIZE, BATCH)
    predicted = choice.cost.saved_bytes
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)
    assert predicted == measured
    assert profile.unmodelled(profile.max_layers) == []
    peak = measured_step_peak(model, STEM_SIZE, BATCH)
    assert abs(peak / choice.cost.peak_bytes - 1) <= 0.10, (
        peak, choice.cost.peak_bytes)


def test_kept_table_names_each_unmodelled_kind():
    from mmseg_gf.accounting.report import step_kept_table
    model = filtered_copy(_gated_model(), 7, 2, SIZE)
    table = step_kept_table(trace_step_saved_bytes(model, SIZE), BATCH)
    lines = table.splitlines()
    assert lines[0] == f'Kept for backward by the whole step, batch {BATCH}'
    kinds = [line.split()[1] for line in lines if line.startswith(
        'unmodelled: ')]
    assert sorted(kinds) == ['LinearGate', 'SELayer', 'Sigmoid']
    assert all(line.rstrip().endswith('measured') for line in lines
               if line.startswith('unmodelled: '))
    assert lines[-1].startswith('total')


@pytest.mark.parametrize('family', ['pidnet_s', 'ddrnet_23_slim'])
def test_own_loss_heads_are_measured(family):
    """Heads with their own ``loss_by_feat`` (PIDNet's, DDRNet's OHEM
    losses): the trace measures what their lean loss keeps instead of the
    rule's estimate; analytic + measured within 3% of autograd's bytes at
    batch 2 (the OHEM loss keeps a data-dependent number of pixels; where
    batch 1 and 2 do not fit a per-image and a constant part, the trace
    scales batch 1)."""
    from mmseg_gf.engine.build import build_segmentor
    from mmseg_gf.engine.zoo import family_config, make_offline
    cfg = make_offline(family_config(family))
    cfg.model.data_preprocessor.size = (128, 128)
    cfg.gradient_filter = dict(num_layers=10, radius=4)
    torch.manual_seed(0)
    model = build_segmentor(cfg, input_size=(128, 128))
    counted = trace_step_saved_bytes(model, (128, 128))
    head = type(model.decode_head).__name__.replace('Lean', '', 1)
    assert f'{head} (loss)' in counted.unmodelled_bytes(BATCH)
    measured = step_saved_bytes(model, (128, 128), BATCH)
    assert abs(counted.total(BATCH) / measured - 1) <= 0.03, (
        counted.total(BATCH), measured)


def test_exact_conv_input_stays_held_while_the_trace_runs():
    """An exact conv's input is remembered by its storage address (convs
    sharing an input keep it once); the storage itself is held, so that
    no later tensor of the trace can take that address and be taken for
    an input already counted."""
    from torch import nn

    from mmseg_gf.accounting.kept import conv_items
    conv = nn.Conv2d(3, 4, 3, padding=1)
    shared = {}
    x = torch.randn(1, 3, 48, 48)
    assert conv_items('conv', conv, x, conv(x), shared)
    ptr = x.untyped_storage().data_ptr()
    del x
    path, storage = shared[ptr]
    assert path == 'conv' and storage.data_ptr() == ptr
    assert storage.nbytes() == 3 * 48 * 48 * 4


def test_traced_model_and_graph_are_freed():
    """A trace leaves nothing alive behind it: the autograd nodes of its
    saved tensors hold its pack hook, which must not hold the tracer (and
    through it the model) once the trace is over. BiSeNetV1's attention
    gates save their Sigmoid's output, the case that kept every traced
    model alive."""
    import gc
    import weakref

    from mmseg_gf.engine.build import build_segmentor
    from mmseg_gf.engine.zoo import family_config, make_offline
    cfg = make_offline(family_config('bisenetv1_r18'))
    cfg.model.data_preprocessor['size'] = SIZE
    model = filtered_copy(build_segmentor(cfg), 5, 2, SIZE)
    trace_step_saved_bytes(model, SIZE)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
