"""What a step keeps when every layer kind is trained (``layer_kinds=None``):
Linears and attentions on token grids beside the convs.

Segformer-B0, Swin-T UPerNet, Twins-PCPVT-S UPerNet, DeiT-S UPerNet and
Segmenter ViT-T from mmseg 1.2.2's zoo, offline and shrunk as in
tests/helpers/token_families.py, at 64x64, float32, GF last 20
layers (Segmenter: 10), r = 4:

* lean on, ``gf`` and ``vanilla``: the step trace models every byte of the
  backbones and the heads (Segmenter's mask head's own code, its class
  masks' norms and product, and its loss's logits included: nothing is
  "unmodelled"), and the analytic total equals autograd's saved bytes of a
  real step at batch 2 (Segmenter also at last 3: its head alone); the
  Linears' bytes are ``'linear'``, not ``'conv'``;
* ``vanilla`` with ``lean=False``: the trained Linears and attentions are
  modelled (what stays unmodelled is the frozen norms, activations and
  losses, as for convs);
* the budget's profile over all kinds predicts the saved bytes of last
  5, 10 and 20 within 10%, the patch-mean GELU rule on (the profile picks
  the very GELUs the trained model's traced step does); its step peak is
  not checked here: at these tiny float32 shapes it misses by 7-41% for
  the conv-only pool too.
"""
import copy

import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.accounting.batch import random_batch, training_loss  # noqa
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.engine.budget import profile_segmentor  # noqa: E402
from mmseg_gf.engine.build import build_segmentor  # noqa: E402
from mmseg_gf.engine.state import get_state  # noqa: E402
from mmseg_gf.models.gf_attention import GFMultiheadAttention  # noqa: E402
from mmseg_gf.models.gf_linear import GFLinear  # noqa: E402
from tests.helpers.engine_fixtures import step_saved_bytes  # noqa: E402
from tests.helpers.token_families import family_config  # noqa: E402

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures('one_thread')]

SIZE = 64
BATCH = 2
NAMES = ('segformer_b0', 'swin_t', 'twins_pcpvt_s', 'deit_s',
         'segmenter_vit_t')


def _cfg(name, **settings):
    cfg = family_config(name)
    cfg.model.data_preprocessor['size'] = (SIZE, SIZE)
    if settings:
        cfg.gradient_filter = dict(radius=4, layer_kinds=None, **settings)
    return cfg


def _layers(name):
    return 10 if name.startswith('segmenter') else 20


def _model(name, mode, lean, layers=None):
    torch.manual_seed(0)
    return build_segmentor(_cfg(name, num_layers=layers or _layers(name),
                                mode=mode, lean=lean))


def _measured(model, batch=BATCH):
    return step_saved_bytes(model, (SIZE, SIZE), batch)


def _token_layers(model):
    return [m for m in model.modules()
            if isinstance(m, (GFLinear, GFMultiheadAttention))]


@pytest.mark.parametrize('mode', ['gf', 'vanilla'])
@pytest.mark.parametrize('name', NAMES)
def test_every_byte_of_trained_token_layers_is_counted(name, mode):
    model = _model(name, mode, True)
    assert _token_layers(model), 'the selection trains no Linear'
    counted = trace_step_saved_bytes(model, (SIZE, SIZE))
    # the trained attentions ran SDPA (mmcv's lean wrapper discards their
    # weights): no probabilities kept
    for m in _token_layers(model):
        if isinstance(m, GFMultiheadAttention):
            assert m._gf_lean_call is not None and \
                m._gf_probabilities_call is None, m
    assert counted.unmodelled_bytes(BATCH) == {}, counted.summary(BATCH)
    assert counted.by_category(BATCH)['attention'] > 0
    assert counted.by_category(BATCH)['linear'] > 0
    # Linears and attentions keep 'linear' (class scores: 'classifier'),
    # SDPA's tensors 'attention': never 'conv'
    linears = {n for n, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, GFMultiheadAttention))}
    assert not [i for i in counted.items
                if i.path in linears and i.category == 'conv']
    assert counted.total(BATCH) == _measured(model), counted.summary(BATCH)


@pytest.mark.parametrize('mode', ['gf', 'vanilla'])
def test_segmenter_head_alone_is_counted(mode):
    """Last 3: Segmenter's mask head's last layer alone trains; its own
    code (class masks) and loss (logits) are counted, nothing measured."""
    model = _model('segmenter_vit_t', mode, True, 3)
    counted = trace_step_saved_bytes(model, (SIZE, SIZE))
    assert counted.unmodelled_bytes(BATCH) == {}, counted.summary(BATCH)
    by_category = counted.by_category(BATCH)
    assert by_category['classifier'] > 0 and by_category['logits'] > 0
    assert counted.total(BATCH) == _measured(model), counted.summary(BATCH)


@pytest.mark.parametrize('name', NAMES)
def test_plain_vanilla_models_its_trained_linears(name):
    """``lean=False``: the frozen kinds keep autograd's defaults (measured),
    the trained Linears and attentions are modelled."""
    model = _model(name, 'vanilla', False)
    counted = trace_step_saved_bytes(model, (SIZE, SIZE))
    kinds = set(counted.unmodelled_bytes(BATCH))
    assert not {k for k in kinds if 'Linear' in k or 'Multihead' in k}, \
        counted.summary(BATCH)


@pytest.mark.parametrize('name', NAMES)
def test_budget_over_all_kinds_predicts_saved_bytes(name):
    torch.manual_seed(0)
    plain = build_segmentor(_cfg(name))
    profile = profile_segmentor(copy.deepcopy(plain), (SIZE, SIZE))
    most = min(20, profile.max_layers)
    kinds = {type(c.module).__name__ for c in profile.convs[-most:]}
    assert kinds & {'GFLinear', 'GFMultiheadAttention'}, kinds
    rule = set()
    for layers in sorted({5, 10, most}):
        cost = profile.cost(layers, 4, BATCH)
        model = _model(name, 'gf', True, layers)
        model.load_state_dict(plain.state_dict())
        gelus = get_state(model).patch_mean_gelus
        assert sorted(profile.patch_mean_gelus(layers, 4)) == gelus, layers
        rule.update(gelus)
        measured = _measured(model)
        assert abs(cost.saved_bytes / measured - 1) <= 0.10, (
            layers, cost.saved_bytes, measured)
    assert rule  # the rule fires in some of these settings


@pytest.mark.parametrize('layers', [16, 26])
def test_a_window_attention_whose_qkv_trains_first_is_lean(layers):
    """Swin's first trained layer is a block's ``qkv`` (16: an unshifted
    block, 26: a shifted one): the block's input needs no gradient, yet its
    attention is recorded, and runs lean (SDPA, nothing unmodelled) with
    the plain step's gradients (float32, rtol 1e-4, atol 1e-5 of the
    largest element)."""
    model = _model('swin_t', 'gf', True, layers)
    assert get_state(model).layers[0].path.endswith('attn.w_msa.qkv')
    counted = trace_step_saved_bytes(model, (SIZE, SIZE))
    assert counted.unmodelled_bytes(BATCH) == {}, counted.summary(BATCH)
    assert counted.total(BATCH) == _measured(model)
    plain = _model('swin_t', 'gf', False, layers)
    inputs, samples = random_batch(model, (SIZE, SIZE), BATCH)
    got, want = (_gradients(m, inputs, samples) for m in (model, plain))
    assert set(got) == set(want) and want
    for key, g in want.items():
        torch.testing.assert_close(got[key], g, rtol=1e-4,
                                   atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m: f'{key}: {m}')


def _gradients(model, inputs, samples):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    training_loss(model, inputs, samples).backward()
    return {n: p.grad for n, p in model.named_parameters()
            if p.grad is not None}


def test_budget_takes_no_gelu_whose_neighbours_differ_in_radius():
    """The patch-mean rule needs the GELU's producer and consumers at one
    radius: with a mixed-radius setting the profile counts that GELU by
    its input again (and the others by their patch means)."""
    torch.manual_seed(0)
    profile = profile_segmentor(build_segmentor(_cfg('segformer_b0')),
                                (SIZE, SIZE))
    most = min(20, profile.max_layers)
    taken = profile.patch_mean_gelus(most, 4)
    assert taken
    path = sorted(taken)[0]
    paths = {c.index: c.path for c in profile.convs}
    producer = next(c.producer for c in profile.gelu_calls
                    if c.path == path)
    radii = dict(profile.radii_for(most, 4))
    radii[paths[producer]] = 2
    mixed = profile.patch_mean_gelus(most, radii)
    assert path not in mixed and set(mixed) == set(taken) - {path}
    # the rule off: every GELU by its input
    off = profile_segmentor(build_segmentor(_cfg('segformer_b0')),
                            (SIZE, SIZE), patch_mean_activations=False)
    assert off.patch_mean_gelus(most, 4) == {}
    assert off.cost(most, 4, BATCH).saved_bytes > \
        profile.cost(most, 4, BATCH).saved_bytes


@pytest.mark.parametrize('trained', ['patch_proj', 'classes_proj'])
def test_segmenter_one_class_score_side_is_counted(trained):
    """Only one of Segmenter's class-score Linears trained (the rest
    frozen): only its side of the class masks needs a gradient, so the
    head's own code keeps one normalisation and the other side's operand
    of the product; ``classes_proj`` reads a slice of the tokens that is
    contiguous at batch 1 but copied at batch 2. Counted to the byte."""
    model = _model('segmenter_vit_t', 'gf', True, 3)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(f'decode_head.{trained}.'))
    counted = trace_step_saved_bytes(model, (SIZE, SIZE))
    assert counted.unmodelled_bytes(BATCH) == {}, counted.summary(BATCH)
    assert counted.total(BATCH) == _measured(model), counted.summary(BATCH)
