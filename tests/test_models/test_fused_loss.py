"""The decode head's classifier fused with its loss, and every head's loss
differentiated in the forward (:mod:`mmseg_gf.ops.loss.gradients`,
:mod:`mmseg_gf.ops.loss.fused_classifier`): the same losses, accuracy and
gradients (input and every parameter) as mmseg's own head (float32, rtol
1e-5), less kept for backward, the classifier's input not kept at all where
the classifier is fused."""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip('mmseg')

from mmseg.models.decode_heads import FCNHead  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402
from mmseg.utils import register_all_modules  # noqa: E402
from tests.helpers.loss_checks import pid_head, random_samples  # noqa: E402

from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from mmseg_gf.models import lean_head  # noqa: E402
from mmseg_gf.models.lean import make_lean  # noqa: E402

register_all_modules(init_default_scope=False)

K = 3  # classes
LOW, HIGH = (5, 6), (20, 24)  # logits' and labels' sizes

FCN_CASES = {
    'ce': dict(loss_decode=dict(type='CrossEntropyLoss')),
    'ce_no_dropout': dict(dropout_ratio=0.0,
                          loss_decode=dict(type='CrossEntropyLoss')),
    'ce_and_dice': dict(loss_decode=[
        dict(type='CrossEntropyLoss', loss_name='loss_ce'),
        dict(type='DiceLoss', loss_name='loss_dice', loss_weight=0.7)]),
    'two_ce_one_name': dict(loss_decode=[
        dict(type='CrossEntropyLoss', loss_weight=1.0),
        dict(type='CrossEntropyLoss', loss_weight=0.5, avg_non_ignore=True)
    ]),
    'sigmoid': dict(loss_decode=dict(type='CrossEntropyLoss',
                                     use_sigmoid=True)),
    'sigmoid_non_ignore_sum': dict(loss_decode=[
        dict(type='CrossEntropyLoss', use_sigmoid=True, loss_weight=0.4,
             avg_non_ignore=True),
        dict(type='CrossEntropyLoss', use_sigmoid=True, reduction='sum',
             loss_name='loss_sum')]),
    'avg_non_ignore': dict(loss_decode=dict(
        type='CrossEntropyLoss', loss_weight=0.4, avg_non_ignore=True)),
    'class_weight': dict(loss_decode=dict(
        type='CrossEntropyLoss', class_weight=[0.5, 1.0, 2.0])),
    'ohem_sampler': dict(
        sampler=dict(type='OHEMPixelSampler', thresh=0.7, min_kept=100),
        loss_decode=dict(type='CrossEntropyLoss')),
    'lovasz': dict(loss_decode=dict(type='LovaszLoss', reduction='none',
                                    loss_name='loss_lovasz')),
}


def _fcn_head(case):
    torch.manual_seed(0)
    cfg = dict(type='FCNHead', in_channels=4, channels=6, num_convs=1,
               num_classes=K, dropout_ratio=0.1, align_corners=False)
    cfg.update(FCN_CASES[case])
    return MODELS.build(cfg)


def _labelled(n, seed, ignore=True, edge=False):
    """:func:`random_samples` of ``K`` classes at ``HIGH``; ``ignore``: an
    ignored band of 4 rows and, of more than two images, the last with no
    label at all."""
    return random_samples(n, K, HIGH, seed, ignored_rows=4 if ignore else 0,
                          blank_last=ignore and n > 2, edges=edge)


def _inputs(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _head_step(head, inputs, samples, scale=1.0):
    """One decode head's ``head.loss`` (inputs made leaves needing a
    gradient) + backward of ``scale`` x the summed losses; gradients
    accumulate into ``.grad`` (as gradient accumulation does)."""
    head.train()
    inputs = [x.requires_grad_(True) for x in inputs]
    torch.manual_seed(3)  # the classifier's dropout draws the same noise
    out = head.loss(inputs, samples, None)
    total = sum(v for k, v in out.items() if 'loss' in k)
    (total * scale).backward()
    return {k: v.detach() for k, v in out.items()}, [x.grad for x in inputs]


def _grads(head):
    return {n: p.grad.clone() for n, p in head.named_parameters()
            if p.grad is not None}


def _assert_close(got, want, what):
    torch.testing.assert_close(
        got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()),
        msg=lambda m: f'{what}: {m}')


def _compare(plain, lean, runs):
    """Run ``runs`` (``(inputs, samples, scale)``) on both heads, one after
    the other without zeroing gradients; compare everything."""
    for inputs, samples, scale in runs:
        want = _head_step(plain, [x.clone() for x in inputs], samples, scale)
        got = _head_step(lean, [x.clone() for x in inputs], samples, scale)
        assert want[0].keys() == got[0].keys()
        for key in want[0]:
            torch.testing.assert_close(got[0][key], want[0][key], rtol=1e-5,
                                       atol=0, msg=lambda m: f'{key}: {m}')
        for i, (g, w) in enumerate(zip(got[1], want[1])):
            _assert_close(g, w, f'input {i} gradient')
    want, got = _grads(plain), _grads(lean)
    assert want.keys() == got.keys()
    for name in want:
        _assert_close(got[name], want[name], name)


def _classifier_input_kept(head, inputs, samples):
    """Whether autograd keeps anything while ``conv_seg`` runs, and whether
    it keeps the storage of ``conv_seg``'s input at all during the step
    (with dropout before the classifier, only the classifier reads it)."""
    seen, inside, kept = [], [], {}

    def enter(module, args):
        inside.append(module)
        seen.append(args[0].untyped_storage().data_ptr())

    def leave(*_):
        inside.pop()

    handles = [head.conv_seg.register_forward_pre_hook(enter),
               head.conv_seg.register_forward_hook(leave)]

    def pack(t):
        if not isinstance(t, nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = bool(inside)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            head.loss([x.clone().requires_grad_(True) for x in inputs],
                      samples, None)
    finally:
        for handle in handles:
            handle.remove()
    return any(kept.values()), seen[0] in kept


def _kept_bytes(head, inputs, samples):
    head.train()
    return saved_tensor_bytes(lambda: head.loss(
        [x.clone().requires_grad_(True) for x in inputs], samples, None))


@pytest.mark.parametrize('case', sorted(FCN_CASES))
def test_fused_head_equals_mmseg_head(case):
    plain = _fcn_head(case)
    lean = copy.deepcopy(plain)
    assert make_lean(lean) == 'loss'
    ignore = case != 'class_weight'  # mmseg's class weights fail on 255
    inputs = _inputs([(3, 4) + LOW], 1)
    samples = _labelled(3, 2, ignore)
    # two steps into the same .grad, the second with a loss scale, as AMP
    # and gradient accumulation run them
    _compare(plain, lean, [(inputs, samples, 1.0),
                           (_inputs([(3, 4) + LOW], 4),
                            _labelled(3, 5, ignore), 1024.0)])
    assert _classifier_input_kept(plain, inputs, samples) == (True, True)
    by_conv, anywhere = _classifier_input_kept(lean, inputs, samples)
    assert not by_conv
    # the classifier reads the ReLU's output itself (a dropout before it is
    # folded into the classifier, which makes no dropped-out copy), and the
    # plain ReLU keeps it
    assert anywhere
    assert _kept_bytes(lean, inputs, samples) < \
        _kept_bytes(plain, inputs, samples)


def test_feature_noise_draws_what_dropout2d_draws():
    """The folded dropout draws torch's own noise from the same random
    numbers: the same channels dropped, the same random state after."""
    x = torch.randn(3, 5, 4, 4)
    torch.manual_seed(11)
    want = nn.functional.dropout2d(x, 0.3, training=True)
    want_state = torch.get_rng_state()
    torch.manual_seed(11)
    got = x * lean_head.feature_noise(x, 0.3)
    assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), want_state)


def _dropout_outputs(head, inputs, samples):
    """Whether each call of ``head.dropout`` in a training ``loss``
    returned its very input (folded into the classifier)."""
    same = []
    handle = head.dropout.register_forward_hook(
        lambda m, args, out: same.append(out is args[0]))
    try:
        head.train()
        head.loss(inputs, samples, None)
    finally:
        handle.remove()
    return same


def _wide_classifier(head):
    conv = head.conv_seg
    head.conv_seg = nn.Conv2d(conv.in_channels, conv.out_channels, 3,
                              padding=1)
    return head


@pytest.mark.parametrize('variant', ['1x1 classifier', '3x3 classifier'])
def test_head_dropout_folds_into_a_pointwise_classifier(variant):
    """A training Dropout2d before a 1x1 classifier runs as a per-image
    scaling of the classifier's weight (its call returns its input, no
    dropped-out copy is made); before a 3x3 classifier it runs as mmseg's.
    Either way: mmseg's losses and gradients."""
    plain = _fcn_head('ce')
    if variant == '3x3 classifier':
        plain = _wide_classifier(plain)
    lean = copy.deepcopy(plain)
    make_lean(lean)
    inputs, samples = _inputs([(3, 4) + LOW], 1), _labelled(3, 2)
    _compare(plain, lean, [(inputs, samples, 1.0)])
    folded = _dropout_outputs(lean, inputs, samples)
    assert folded == [variant == '1x1 classifier']


def test_only_a_training_feature_dropout_folds():
    head = _fcn_head('ce').train()
    feat = torch.randn(2, 6, 3, 3)
    fold = lean_head.folds_into_classifier
    assert fold(head.dropout, feat, head.conv_seg)
    assert not fold(head.dropout, feat[0], head.conv_seg)  # 3-d input
    assert not fold(nn.Dropout2d(0.1, inplace=True), feat, head.conv_seg)
    assert not fold(nn.Dropout(0.1), feat, head.conv_seg)
    assert not fold(nn.Dropout2d(0.0), feat, head.conv_seg)
    assert not fold(nn.Dropout2d(1.0), feat, head.conv_seg)
    assert not fold(head.dropout.eval(), feat, head.conv_seg)


def test_classifier_only_training_keeps_no_logits_gradient():
    """A frozen head whose classifier alone trains: the fused loss keeps
    g_W and g_b only (the classifier's input needs no gradient)."""
    plain = _fcn_head('ce_and_dice')
    for name, p in plain.named_parameters():
        p.requires_grad_(name.startswith('conv_seg'))
    lean = copy.deepcopy(plain)
    make_lean(lean)
    inputs, samples = _inputs([(2, 4) + LOW], 1), _labelled(2, 2)
    for head in (plain, lean):
        head.train()
        torch.manual_seed(3)
        out = head.loss(inputs, samples, None)
        sum(v for k, v in out.items() if 'loss' in k).backward()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            _assert_close(dict(lean.named_parameters())[name].grad, p.grad,
                          name)
    conv = lean.conv_seg
    two_names = 2
    assert saved_tensor_bytes(lambda: lean.loss(inputs, samples, None)) == \
        two_names * 4 * (conv.weight.numel() + conv.bias.numel())


def _ddr_head():
    torch.manual_seed(0)
    return MODELS.build(dict(
        type='DDRHead', in_channels=8, channels=4, num_classes=K,
        align_corners=False, loss_decode=[
            dict(type='OhemCrossEntropy', thres=0.9, min_kept=50,
                 loss_weight=1.0),
            dict(type='OhemCrossEntropy', thres=0.9, min_kept=50,
                 loss_weight=0.4)]))


def _stdc_head():
    torch.manual_seed(0)
    return MODELS.build(dict(
        type='STDCHead', in_channels=4, channels=6, num_convs=1,
        num_classes=2, boundary_threshold=0.1, concat_input=False,
        align_corners=True, loss_decode=[
            dict(type='CrossEntropyLoss', loss_name='loss_ce',
                 use_sigmoid=True, loss_weight=1.0),
            dict(type='DiceLoss', loss_name='loss_dice', loss_weight=1.0)]))


MULTI_CASES = {
    'pidnet': (lambda: pid_head(K, min_kept=50),
               [(2, 4) + LOW, (2, 8) + LOW, (2, 4) + LOW], True),
    'ddrnet': (_ddr_head, [(2, 4) + LOW, (2, 8) + LOW], False),
    'stdc_detail': (_stdc_head, [(2, 4) + LOW], False),
}


@pytest.mark.parametrize('case', sorted(MULTI_CASES))
def test_own_loss_by_feat_heads_equal_mmseg(case):
    """Heads with their own ``loss_by_feat`` (tuple logits, OHEM
    cross-entropy, boundary and detail losses): the loss runs once, its
    gradients are kept at the logits' resolution, ``conv_seg`` (whose
    output is one of the tuple's) is fused and keeps nothing."""
    build, shapes, edge = MULTI_CASES[case]
    plain = build()
    lean = copy.deepcopy(plain)
    assert make_lean(lean) == 'loss'
    inputs = _inputs(shapes, 1)
    samples = _labelled(2, 2, ignore=case != 'stdc_detail', edge=edge)
    _compare(plain, lean, [(inputs, samples, 1.0),
                           (_inputs(shapes, 4), samples, 512.0)])
    assert _kept_bytes(lean, inputs, samples) < \
        _kept_bytes(plain, inputs, samples)
    assert _classifier_input_kept(plain, inputs, samples)[0]
    assert not _classifier_input_kept(lean, inputs, samples)[0]


class _ScaledLogitsHead(FCNHead):
    """A head whose forward transforms its classifier's output."""

    def forward(self, inputs):
        return super().forward(inputs) * 2.0


def _not_a_plain_conv(head):
    conv = head.conv_seg
    head.conv_seg = nn.Sequential(conv)
    return head


FALLBACKS = {
    'forward transforms the logits': (
        lambda: _ScaledLogitsHead(in_channels=4, channels=6, num_convs=1,
                                  num_classes=K, dropout_ratio=0.1),
        'does not return the classifier'),
    'classifier not a Conv2d': (
        lambda: _not_a_plain_conv(_fcn_head('ce')), 'not a zero-padded'),
    'loss not a scalar': (
        lambda: FCNHead(in_channels=4, channels=6, num_convs=1,
                        num_classes=K, dropout_ratio=0.1,
                        loss_decode=dict(type='CrossEntropyLoss',
                                         reduction='none')),
        'only scalar losses'),
}


def _captured_logs(monkeypatch):
    """What lean_head logs from now on (its log-once memory emptied)."""
    logged = []
    monkeypatch.setattr(lean_head, 'print_log',
                        lambda msg, **kw: logged.append(msg))
    monkeypatch.setattr(lean_head, '_LOGGED', set())
    return logged


@pytest.mark.parametrize('case', sorted(FALLBACKS))
def test_fallback_is_exact_and_logged_once(case, monkeypatch):
    build, reason = FALLBACKS[case]
    torch.manual_seed(0)
    plain = build()
    lean = copy.deepcopy(plain)
    make_lean(lean)
    logged = _captured_logs(monkeypatch)
    inputs, samples = _inputs([(2, 4) + LOW], 1), _labelled(2, 2)
    for head in (plain, lean):  # losses summed over pixels if not scalar
        for seed in (3, 4):
            head.train()
            torch.manual_seed(seed)
            out = head.loss([x.clone().requires_grad_(True) for x in inputs],
                            samples, None)
            sum(v.sum() for k, v in out.items() if 'loss' in k).backward()
    for name, p in plain.named_parameters():
        _assert_close(dict(lean.named_parameters())[name].grad, p.grad, name)
    fusion = [m for m in logged if 'classifier not fused' in m]
    assert len(fusion) == 1 and reason in fusion[0], logged


@pytest.mark.parametrize('loss, reason', [
    (dict(type='DiceLoss'), 'DiceLoss is not mmseg\'s CrossEntropyLoss'),
    (dict(type='CrossEntropyLoss', reduction='none'), "reduction 'none'"),
])
def test_whole_batch_loss_is_logged_once(loss, reason, monkeypatch):
    """A loss the image-by-image path does not mirror runs mmseg's
    loss_by_feat on the whole batch; the reason is logged once."""
    lean = FCNHead(in_channels=4, channels=6, num_convs=1, num_classes=K,
                   loss_decode=loss)
    make_lean(lean)
    logged = _captured_logs(monkeypatch)
    inputs, samples = _inputs([(2, 4) + LOW], 1), _labelled(2, 2)
    for _ in range(2):
        out = lean.loss([x.clone().requires_grad_(True) for x in inputs],
                        samples, None)
        sum(v.sum() for k, v in out.items() if 'loss' in k).backward()
    whole = [m for m in logged if 'whole batch' in m]
    assert len(whole) == 1 and reason in whole[0], logged


@pytest.mark.parametrize('case', ['ce', 'ce_and_dice'])
def test_bfloat16_autocast_within_its_rounding(case):
    """Under CPU autocast the classifier and the loss run in bfloat16 as
    mmseg's do; gradients come back in float32 and differ from autograd's
    only by where bfloat16 rounds (its epsilon is 2^-7: a few of them)."""
    plain = _fcn_head(case)
    lean = copy.deepcopy(plain)
    make_lean(lean)
    inputs, samples = _inputs([(3, 4) + LOW], 1), _labelled(3, 2)
    results = []
    for head in (plain, lean):
        head.train()
        x = inputs[0].clone().requires_grad_(True)
        torch.manual_seed(3)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = head.loss([x], samples, None)
            total = sum(v for k, v in out.items() if 'loss' in k)
        (total * 1024.0).backward()
        grads = dict(x=x.grad, **{n: p.grad for n, p in
                                  head.named_parameters()})
        results.append(({k: v.detach() for k, v in out.items()}, grads))
    (want, want_grads), (got, got_grads) = results
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=2 ** -6, atol=0)
    for name, g in want_grads.items():
        assert got_grads[name].dtype == g.dtype == torch.float32
        torch.testing.assert_close(got_grads[name], g, rtol=0,
                                   atol=2 ** -5 * float(g.abs().max()),
                                   msg=lambda m: f'{name}: {m}')


def test_classifier_input_and_logits_are_freed_after_the_loss():
    """Nothing refers to the classifier's input or output once ``loss``
    returns (the held saved tensors make no reference cycle)."""
    import gc
    import weakref
    lean = _fcn_head('ce')
    make_lean(lean)
    refs = []
    lean.conv_seg.register_forward_hook(lambda m, args, out: refs.extend(
        [weakref.ref(args[0]), weakref.ref(out)]))
    lean.train()
    losses = lean.loss([_inputs([(2, 4) + LOW], 1)[0].requires_grad_(True)],
                       _labelled(2, 2), None)
    gc.collect()
    assert losses['loss_ce'].requires_grad
    assert [r() for r in refs] == [None, None]


def _outcome(head, inputs, samples):
    """What ``head.loss`` gives: ``('ok', losses)`` or ``(error type,
    message)``; no backward."""
    head.train()
    torch.manual_seed(3)
    try:
        out = head.loss([x.clone().requires_grad_(True) for x in inputs],
                        samples, None)
    except Exception as error:  # mmseg's own error is the point
        return type(error).__name__, str(error)
    return 'ok', {k: v.detach() for k, v in out.items()}


@pytest.mark.parametrize('case', ['ce', 'class_weight', 'sigmoid',
                                  'ohem_sampler'])
def test_a_bad_label_fails_its_batch_only(case):
    """A label outside [0, K) that is not ignored: that batch gets what
    mmseg's own loss gives (its error, the same type and message), and the
    next clean batch runs the lean loss again: mmseg's losses and
    gradients, and no more kept for backward than a lean head that never
    saw the bad batch."""
    plain = _fcn_head(case)
    lean = copy.deepcopy(plain)
    make_lean(lean)
    fresh = copy.deepcopy(lean)
    inputs = _inputs([(2, 4) + LOW], 1)
    bad = _labelled(2, 2)
    bad[0].gt_sem_seg.data[0, 7, 9] = K
    want, got = _outcome(plain, inputs, bad), _outcome(lean, inputs, bad)
    assert got[0] == want[0]
    if want[0] == 'ok':
        for key in want[1]:
            torch.testing.assert_close(got[1][key], want[1][key], rtol=1e-5,
                                       atol=0, equal_nan=True)
    else:
        assert got[1] == want[1]
    clean = _labelled(2, 3, ignore=False)  # mmseg 1.2.2's class weights
    assert _kept_bytes(lean, inputs, clean) == \
        _kept_bytes(fresh, inputs, clean)
    for head in (plain, lean):
        head.zero_grad(set_to_none=True)
    _compare(plain, lean, [(inputs, clean, 1.0)])


def _nan_input():
    """One image's input pixel NaN."""
    inputs = _inputs([(2, 4) + LOW], 1)
    inputs[0][0, :, 2, 3] = float('nan')
    return inputs


@pytest.mark.parametrize('native', [True, False], ids=['kernel', 'pytorch'])
@pytest.mark.parametrize('partial', [True, False])
@pytest.mark.parametrize('case', ['ce', 'sigmoid', 'ohem_sampler'])
def test_nan_input_gives_mmseg_accuracy(case, partial, native,
                                       switch_override):
    """A NaN input pixel: NaN loss on both heads, and the accuracy that
    mmseg's ``accuracy`` (``topk`` over the upsampled logits) gives, on the
    compiled kernel's path and on the pure-PyTorch path. ``partial``: norms
    in eval mode, so NaN reaches the logits near that pixel only
    (train-mode BN spreads it to every logit of the batch)."""
    from mmseg_gf.ops.resized_loss import loss as resized_loss
    if native and resized_loss._kernel is None:
        pytest.skip('compiled kernel not built')
    if not native:
        switch_override(MMSEG_GF_NATIVE=False)
    plain = _fcn_head(case)
    lean = copy.deepcopy(plain)
    make_lean(lean)
    inputs, samples = _nan_input(), _labelled(2, 2)
    outs = []
    for head in (plain, lean):
        head.train()
        if partial:
            for m in head.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        torch.manual_seed(3)
        outs.append(head.loss([x.clone().requires_grad_(True)
                               for x in inputs], samples, None))
    want, got = outs
    loss = [k for k in want if 'loss' in k]
    assert all(torch.isnan(want[k]) and torch.isnan(got[k]) for k in loss)
    assert torch.equal(got['acc_seg'], want['acc_seg']), (
        got['acc_seg'], want['acc_seg'])
