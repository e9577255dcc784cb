"""Frozen auxiliary heads are left out of a step: those on frozen features
train nothing, those on trained features are cut off from the backbone.

A tiny FCN-R18 (``tests/helpers/engine_fixtures.py``) with FCN auxiliary heads,
last 5 convs trained (``backbone.layer4.1`` and the decode head): a head on
``layer3`` (``in_index=2``) reads features that need no gradient, a head on
``layer4`` (``in_index=3``) reads trained ones. References are the same
model with every head run (``keep_frozen_aux_heads=True``, mmseg's own
``_auxiliary_head_forward_train``), its gradients those of every loss (a
head on frozen features) or of the decode head's alone (trained features).
The zoo models after a class-count change:
``test_frozen_aux_heads_transfer.py``.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from tests.helpers.engine_fixtures import (  # noqa: E402
    NORM, filtered_copy, model_cfg)
from tests.helpers.lean_steps import training_step  # noqa: E402

from mmseg_gf.accounting.batch import (random_batch,  # noqa: E402
                                       training_loss)
from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from mmseg_gf.accounting.saved_bytes import (  # noqa: E402
    trace_step_saved_bytes)
from mmseg_gf.accounting.trace import StepTracer  # noqa: E402
from mmseg_gf.engine.config import (build_grad_filter_model,  # noqa: E402
                                    check_settings)
from mmseg_gf.engine.frozen_aux_heads import (  # noqa: E402
    frozen_head_reason, run_frozen_aux_heads, skips_frozen_aux_heads)
from mmseg_gf.engine.hooks import GradFilterHook  # noqa: E402
from mmseg_gf.engine.lean_region import (lean_counts,  # noqa: E402
                                         remove_lean_region)
from mmseg_gf.engine.state import get_state  # noqa: E402
from mmseg_gf.models.segmentor import set_frozen_norms_eval  # noqa: E402
from mmseg_gf.patching import plain_class  # noqa: E402

SIZE = (64, 64)
CHANNELS = {2: 256, 3: 512}  # ResNet-18 layer3, layer4


def _aux(in_index, loss_weight=0.4, dropout=0.1):
    return dict(type='FCNHead', in_channels=CHANNELS[in_index],
                in_index=in_index, channels=16, num_convs=1,
                concat_input=False, dropout_ratio=dropout, num_classes=3,
                norm_cfg=NORM, align_corners=False,
                loss_decode=dict(type='CrossEntropyLoss',
                                 loss_weight=loss_weight))


def _cfg(aux, cascade=False):
    cfg = model_cfg('fcn_r18')
    cfg['auxiliary_head'] = aux
    if cascade:  # OCRNet's structure: an FCN head, then an OCR head
        fcn = dict(cfg['decode_head'], num_convs=1, concat_input=False,
                   channels=32)
        ocr = dict(type='OCRHead', in_channels=512, in_index=3, channels=32,
                   ocr_channels=16, dropout_ratio=0.1, num_classes=3,
                   norm_cfg=NORM, align_corners=False,
                   loss_decode=dict(type='CrossEntropyLoss'))
        cfg.update(type='CascadeEncoderDecoder', num_stages=2,
                   decode_head=[fcn, ocr])
    return cfg


def _base(aux, cascade=False):
    from mmengine.config import ConfigDict
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    torch.manual_seed(0)
    return MODELS.build(ConfigDict(_cfg(aux, cascade)))


def _prepared(base, **flags):
    return filtered_copy(base, 5, 4, SIZE, **flags)


def _batch_step(model, batch, **kwargs):
    """:func:`training_step` on ``batch`` with this file's dropout seed."""
    return training_step(model, *batch, seed=3, **kwargs)


def _count_calls(model):
    """Calls of every auxiliary classifier (mmseg calls the heads'
    ``forward`` directly, their leaf modules through ``__call__``)."""
    calls = {}
    for name, m in model.named_modules():
        if name.startswith('auxiliary_head') and name.endswith('conv_seg'):
            calls[name] = 0
            m.register_forward_hook(
                lambda mod, a, o, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def _assert_same_tensors(got, want):
    assert got.keys() == want.keys()
    for key, g in want.items():
        torch.testing.assert_close(got[key], g, rtol=1e-5, atol=0, msg=key)


def test_frozen_head_on_frozen_features_is_skipped(log_records):
    base = _base(_aux(2))
    batch = random_batch(base, SIZE, 2, label_block=4)
    kept = _prepared(base, keep_frozen_aux_heads=True)
    skipping = _prepared(base)
    assert skips_frozen_aux_heads(skipping)
    assert not skips_frozen_aux_heads(kept)
    assert type(kept) is type(base)
    assert isinstance(skipping, type(base))
    calls = _count_calls(skipping)
    for _ in range(2):
        want_losses, want = _batch_step(kept, batch)
        got_losses, got = _batch_step(skipping, batch)
        _assert_same_tensors(got, want)
    assert calls == {'auxiliary_head.conv_seg': 0}
    assert 'aux.loss_ce' in want_losses and 'aux.loss_ce' not in got_losses
    torch.testing.assert_close(got_losses['decode.loss_ce'],
                               want_losses['decode.loss_ce'], rtol=0, atol=0)
    logged = [m for m in log_records if 'auxiliary_head' in m]
    assert len(logged) == 1, log_records
    assert 'not run in training' in logged[0]
    assert 'in_index 2' in logged[0]
    assert 'keep_frozen_aux_heads=True' in logged[0]


def test_logged_losses_are_the_plain_values_without_a_graph():
    base = _base(_aux(2))
    batch = random_batch(base, SIZE, 2, label_block=4)
    want_losses, want = _batch_step(
        _prepared(base, keep_frozen_aux_heads=True), batch)
    got_losses, got = _batch_step(
        _prepared(base, log_frozen_aux_losses=True), batch)
    _assert_same_tensors(got, want)
    assert got_losses.keys() == want_losses.keys()
    for key in ('aux.loss_ce', 'aux.acc_seg'):
        assert not got_losses[key].requires_grad
        torch.testing.assert_close(got_losses[key], want_losses[key],
                                   rtol=1e-6, atol=0)


def test_mmengine_parse_losses_and_update_with_logged_losses():
    """mmengine's train step path: ``parse_losses`` sums the detached
    terms into the logged total (mmseg's), the optimizer wrapper's
    backward and step run, and the update is the one of every head run."""
    from mmengine.optim import OptimWrapper
    base = _base(_aux(2))
    batch = random_batch(base, SIZE, 2, label_block=4)
    results = []
    for flags in (dict(keep_frozen_aux_heads=True),
                  dict(log_frozen_aux_losses=True)):
        model = _prepared(base, **flags)
        model.train()
        set_frozen_norms_eval(model)
        wrapper = OptimWrapper(torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.1))
        torch.manual_seed(3)
        loss, log_vars = model.parse_losses(model.loss(*batch))
        wrapper.update_params(loss)
        results.append((log_vars, {n: p.detach().clone() for n, p in
                                   model.named_parameters()}))
    (want_log, want), (got_log, got) = results
    assert got_log.keys() == want_log.keys()
    torch.testing.assert_close(got_log['loss'], want_log['loss'],
                               rtol=1e-6, atol=0)
    _assert_same_tensors(got, want)


def test_frozen_heads_on_trained_features_are_cut_off(log_records):
    # no dropout: a skipped head draws no mask, so a later head's masks
    # would differ from the run with every head
    base = _base([_aux(2, dropout=0.0), _aux(3, dropout=0.0)])
    batch = random_batch(base, SIZE, 2, label_block=4)
    kept = _prepared(base, keep_frozen_aux_heads=True)
    skipping = _prepared(base)
    calls = _count_calls(skipping)
    want_losses, with_aux = _batch_step(kept, batch)
    # the reference of a step whose frozen heads are cut off
    want = _batch_step(kept, batch, leave_out=('aux', ))[1]
    got_losses, got = _batch_step(skipping, batch)
    _assert_same_tensors(got, want)
    # the head on layer4 reads trained features: run, it trains them
    diff = with_aux['backbone.layer4.1.conv2.weight'] - \
        want['backbone.layer4.1.conv2.weight']
    assert diff.abs().max() > 1e-4
    assert calls == {'auxiliary_head.0.conv_seg': 0,
                     'auxiliary_head.1.conv_seg': 0}
    assert not any(k.startswith('aux') for k in got_losses)
    torch.testing.assert_close(got_losses['decode.loss_ce'],
                               want_losses['decode.loss_ce'], rtol=0, atol=0)
    cut = [m for m in log_records if 'auxiliary_head.1 ' in m]
    assert len(cut) == 1 and 'cut off from the backbone' in cut[0]
    assert 'in_index 3' in cut[0] and '\n' not in cut[0]
    # a trained parameter in the head: it runs (decided at every call)
    for model in (kept, skipping):
        model.auxiliary_head[0].conv_seg.requires_grad_(True)
    want_losses, want = _batch_step(kept, batch)
    got_losses, got = _batch_step(skipping, batch)
    assert calls['auxiliary_head.0.conv_seg'] == 1
    assert 'auxiliary_head.0.conv_seg.weight' in got
    assert 'aux_0.loss_ce' in got_losses
    # the reference runs the frozen head on layer4 as well
    assert 'auxiliary_head.1.conv_seg.weight' not in got
    assert 'aux_1.loss_ce' in want_losses and 'aux_1.loss_ce' not in \
        got_losses


def test_frozen_head_reason_reads_the_in_index_selection():
    base = _base([_aux(2), _aux(3)])
    feats = [torch.zeros(1), torch.zeros(1), torch.zeros(1),
             torch.zeros(1, requires_grad=True)]
    head2, head3 = base.auxiliary_head
    for p in base.parameters():
        p.requires_grad_(False)
    assert 'in_index 2) needs no gradient' in frozen_head_reason(
        head2, feats)
    assert 'cut off' in frozen_head_reason(head3, feats)
    head2.in_index = [1, 3]
    assert 'cut off' in frozen_head_reason(head2, feats)
    head2.conv_seg.weight.requires_grad_(True)
    assert frozen_head_reason(head2, feats) is None


def test_cascade_segmentor_skips_too():
    base = _base(_aux(2), cascade=True)
    batch = random_batch(base, SIZE, 2, label_block=4)
    kept = _prepared(base, keep_frozen_aux_heads=True)
    skipping = _prepared(base)
    assert type(base).__name__ == 'CascadeEncoderDecoder'
    assert skips_frozen_aux_heads(skipping)
    calls = _count_calls(skipping)
    want_losses, want = _batch_step(kept, batch)
    got_losses, got = _batch_step(skipping, batch)
    _assert_same_tensors(got, want)
    assert calls == {'auxiliary_head.conv_seg': 0}
    assert 'aux.loss_ce' not in got_losses


def test_the_step_trace_sees_the_skip():
    """The accounting traces ``model.loss``: no call of a skipped head;
    with the head run, its calls record nothing either (no kept bytes)."""
    base = _base(_aux(2))
    for keep in (False, True):
        model = _prepared(base, keep_frozen_aux_heads=keep)
        paths = []
        tracer = StepTracer(model, lambda call: paths.append(
            (call.path, call.recorded)))
        with tracer.hooked():
            tracer.step(random_batch(model, SIZE, 1))
        aux = [p for p in paths if p[0].startswith('auxiliary_head')]
        assert bool(aux) == keep
        assert not any(recorded for _, recorded in aux)


def test_frozen_head_on_trained_features_keeps_what_is_counted():
    """An auxiliary head fed by trained features runs; its frozen convs
    keep nothing (lean frozen conv), its lean loss its logits: the bytes
    autograd saves equal the analytic count, less than without lean."""
    base = _base(_aux(3))
    inputs, samples = random_batch(base, SIZE, 2, label_block=4)
    kept = {}
    for lean in (True, False):
        # run as mmseg does (a frozen head on trained features is cut off)
        model = _prepared(base, lean=lean, keep_frozen_aux_heads=True)
        kept[lean] = saved_tensor_bytes(
            lambda: training_loss(model, inputs, samples))
        if lean:
            counted = trace_step_saved_bytes(model, SIZE)
            assert not counted.unmodelled, counted.unmodelled
            assert counted.total(2) == kept[True]
            aux_items = [i.category for i in counted.items
                         if i.path.startswith('auxiliary_head')]
            # its convs keep nothing; its norm, activation, dropout (folded
            # into its classifier) and loss keep what the lean region keeps
            assert sorted(aux_items) == [
                'activation', 'dropout', 'logits', 'norm']
    assert kept[True] < kept[False]


def test_undo_and_no_aux_head():
    base = _base(_aux(2))
    model = _prepared(base)
    assert run_frozen_aux_heads(model) and type(model) is type(base)
    assert not run_frozen_aux_heads(model)
    plain = _base(None)
    assert not skips_frozen_aux_heads(_prepared(plain))


@pytest.mark.parametrize('key', ['keep_frozen_aux_heads',
                                 'log_frozen_aux_losses'])
def test_bad_setting_is_a_clear_error(key):
    with pytest.raises(ValueError, match=f'{key} must be True or False'):
        check_settings({'num_layers': 5, key: 'yes'})
    with pytest.raises(ValueError, match=f'{key} must be True or False'):
        GradFilterHook(num_layers=5, **{key: 1})


def test_settings_reach_the_built_model():
    from mmengine.config import ConfigDict
    _base(None)  # mmseg's default scope
    for keep in (False, True):
        model = build_grad_filter_model(
            ConfigDict(_cfg(_aux(2))), num_layers=5, radius=4, input_size=SIZE,
            keep_frozen_aux_heads=keep, log_frozen_aux_losses=True)
        state = get_state(model)
        assert state.keep_frozen_aux_heads == keep
        assert state.log_frozen_aux_losses
        assert skips_frozen_aux_heads(model) == (not keep)


def test_removing_the_lean_region_keeps_the_segmentors_swap():
    """Each owner of class swaps undoes its own: the lean region's removal
    gives every lean module its plain class and leaves the segmentor's;
    running the frozen heads again gives the segmentor its plain class."""
    base = _base(_aux(2))
    model = _prepared(base, lean=True)
    assert skips_frozen_aux_heads(model) and lean_counts(model)
    assert remove_lean_region(model) > 0 and not lean_counts(model)
    assert skips_frozen_aux_heads(model)
    plain = dict(base.named_modules())
    assert all(type(m) is type(plain[p]) for p, m in model.named_modules()
               if p and p in plain and plain_class(m) is type(plain[p]))
    assert run_frozen_aux_heads(model) and type(model) is type(base)
