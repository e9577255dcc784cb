"""The last N layers of transformer segmentors: convs, Linears and
attentions on token grids counted together in execution order
(docs/gradient_filter.md#linear-layers-on-token-grids).

For eight tiny zoo families (mmseg 1.2.2's configs shrunk as in
tests/helpers/token_families.py, 64x64, batch 2), the settings go
through the config path (``check_settings`` -> ``select_and_apply``) with
``num_layers=20`` (10 on the tiny Segmenter, which has 11 layers besides
its classifier; 36 on the tiny DPT, whose head alone runs 32), and:

* the choice reaches layers of the backbone's last block, filtered Linears /
  attentions among them, and a training step runs;
* at r = 1 the filtered Linears and attentions are exact: the step's loss
  and gradients equal those of the same model with their filter switched
  off (``enabled=False``; its convs filtered at r = 1 in both, as a conv's
  filter with a kernel larger than 1x1 is not exact at r = 1), float64,
  rtol 1e-10;
* the lean region changes nothing: at r = 4, ``lean=True`` equals
  ``lean=False`` (float32; loss and gradients rtol 1e-4, gradients atol
  1e-5 of the largest element, as
  tests/test_engine/test_lean_transformer_families.py: the lean step's
  attentions, filtered ones included, sum through SDPA in another order).

Also: ``layer_kinds=['conv2d']`` keeps the conv-only count, a bad
``layer_kinds`` is refused naming the allowed values, containers and
Linear paths are accepted by ``layers=``, Segmenter's class-score
Linears are its classifier (always trained, not counted), Linears on no
grid (CGNet's global-context FCs) are not counted and refused when named,
the hook's table shows each layer's kind cell, ``state_dict`` keeps plain
keys, a deep copy filters with its own grids, and a budget chooses among
every kind unless ``layer_kinds`` narrows it.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.accounting.batch import random_batch  # noqa: E402
from mmseg_gf.engine.config import (check_settings,  # noqa: E402
                                    select_and_apply)
from mmseg_gf.engine.selection import select_layers  # noqa: E402
from mmseg_gf.models.gf_attention import GFMultiheadAttention  # noqa: E402
from mmseg_gf.models.gf_linear import GFLinear  # noqa: E402
from tests.helpers.lean_steps import one_step  # noqa: E402
from tests.helpers.token_families import SIZE, tiny_model  # noqa: E402

#: layers counted by the tests (the tiny Segmenter has 11; the tiny DPT's
#: head runs 32, its readout projections among them).
NUM_LAYERS = dict(segmenter_vit_t=10, dpt_vit_b=36)
#: family -> the prefix of its backbone's last block.
LAST_BLOCK = {
    'swin_t': 'backbone.stages.3.blocks.0',
    'segformer_b0': 'backbone.layers.3.1.0',
    'twins_pcpvt_s': 'backbone.layers.3.0',
    'deit_s': 'backbone.layers.3',
    'segmenter_vit_t': 'backbone.layers.1',
    'beit_b': 'backbone.layers.3',
    'mae_b': 'backbone.layers.3',
    'dpt_vit_b': 'backbone.layers.3',
}


pytestmark = pytest.mark.usefixtures('one_thread')


def _filtered(name, dtype, **settings):
    model = tiny_model(name).to(dtype)
    settings = check_settings(
        dict(num_layers=NUM_LAYERS.get(name, 20), **settings))
    choices = select_and_apply(model, settings, (SIZE, SIZE))
    return model, choices


def _total_loss_step(model, inputs, samples):
    """The step's total loss (its terms summed) and gradients
    (:func:`one_step`)."""
    terms, grads = one_step(model, inputs, samples)
    return sum(terms.values()), grads


def _batch(model, dtype):
    inputs, samples = random_batch(model, (SIZE, SIZE), 2, label_block=4)
    return inputs.to(dtype), samples


def _close(got, want, where, rtol, atol_rel):
    loss_got, grads_got = got
    loss_want, grads_want = want
    torch.testing.assert_close(loss_got, loss_want, rtol=rtol, atol=0)
    assert set(grads_got) == set(grads_want), where
    for key, g in grads_want.items():
        torch.testing.assert_close(
            grads_got[key], g, rtol=rtol,
            atol=atol_rel * float(g.abs().max()),
            msg=lambda m: f'{where} {key}: {m}')


@pytest.mark.parametrize('name', list(LAST_BLOCK))
def test_last_20_layers_reach_the_last_block_and_train_exactly(name):
    gf1, choices = _filtered(name, torch.float64, radius=1, lean=False)
    paths = [c.path for c in choices]
    assert len(choices) == NUM_LAYERS.get(name, 20), paths
    assert any(p.startswith(LAST_BLOCK[name] + '.') for p in paths), paths
    tokens = [c for c in choices if c.kind in ('linear', 'attention')]
    assert tokens, paths
    assert all(isinstance(c.module, (GFLinear, GFMultiheadAttention))
               for c in tokens)
    assert all(c.geometry.grid is not None for c in tokens)
    inputs, samples = _batch(gf1, torch.float64)
    exact, exact_choices = _filtered(name, torch.float64, radius=1,
                                     lean=False)
    for choice in exact_choices:
        if choice.kind in ('linear', 'attention'):
            choice.module.enabled = False
    _close(_total_loss_step(gf1, inputs, samples),
           _total_loss_step(exact, inputs, samples), f'{name} r=1', 1e-10,
           1e-12)
    assert _total_loss_step(gf1, inputs, samples)[1], name

    plain, _ = _filtered(name, torch.float32, radius=4, lean=False)
    lean, _ = _filtered(name, torch.float32, radius=4, lean=True)
    inputs = inputs.float()
    want = _total_loss_step(plain, inputs, samples)
    # (lean: the filtered attentions through SDPA, which sums in another
    # order than the bmm path torch's need_weights=True call runs)
    _close(_total_loss_step(lean, inputs, samples), want, f'{name} lean',
           1e-4, 1e-5)
    # the filter acts: r = 4 differs from the exact gradients
    exact32, _ = _filtered(name, torch.float32, radius=4, lean=False,
                           mode='vanilla')
    exact_grads = _total_loss_step(exact32, inputs, samples)[1]
    assert any(not torch.allclose(want[1][k], exact_grads[k], rtol=1e-3)
               for k in exact_grads), name


def test_conv_only_setting_keeps_the_papers_count():
    model = tiny_model('swin_t')
    convs = select_layers(model, num_layers=5, input_size=(SIZE, SIZE),
                          layer_kinds=['conv2d'])
    assert {c.kind for c in convs} == {'conv2d'}
    every = select_layers(model, layers=['backbone.stages.3.blocks.0'],
                          input_size=(SIZE, SIZE))
    assert every and all(c.path.startswith('backbone.stages.3.blocks.0.')
                         for c in every)
    assert {c.kind for c in every} == {'linear'}
    one = select_layers(model, layers=['backbone.stages.3.blocks.0.ffn.'
                                       'layers.1'], input_size=(SIZE, SIZE))
    assert [c.path for c in one] == ['backbone.stages.3.blocks.0.ffn.layers.1']
    with pytest.raises(ValueError, match=r"layer_kinds.*\['conv2d', "
                       r"'linear', 'attention'\]"):
        select_layers(model, num_layers=5, input_size=(SIZE, SIZE),
                      layer_kinds=['conv'])
    with pytest.raises(ValueError, match='layer_kinds'):
        check_settings(dict(num_layers=5, layer_kinds='linearr'))
    with pytest.raises(ValueError, match='contains no layer of the kinds'):
        select_layers(model, layers=['backbone.stages.3.blocks.0'],
                      input_size=(SIZE, SIZE), layer_kinds=['conv2d'])


def test_segmenter_class_scores_are_its_classifier():
    model, choices = _filtered('segmenter_vit_t', torch.float32, radius=4)
    paths = [c.path for c in choices]
    assert not any(p.endswith(('patch_proj', 'classes_proj')) for p in paths)
    trained = {n.rsplit('.', 1)[0] for n, p in model.named_parameters()
               if p.requires_grad}
    assert {'decode_head.patch_proj', 'decode_head.classes_proj'} <= trained
    # a class-score layer is the classifier: naming it is refused by name
    with pytest.raises(ValueError, match="classes_proj' is a decode head's "
                       r'classifier \(class scores\)'):
        select_layers(tiny_model('segmenter_vit_t'),
                      layers=['decode_head.classes_proj'],
                      input_size=(SIZE, SIZE))


class _Logger:
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(str(msg))


class _Runner:
    cfg = None

    def __init__(self):
        self.logger = _Logger()


def test_hook_table_names_kinds_and_grids_and_state_dict_stays_plain():
    from mmseg_gf.engine.hooks.grad_filter_hook import GradFilterHook
    from mmseg_gf.engine.surgery import get_gradient_filter_layers
    plain_keys = list(tiny_model('swin_t').state_dict())
    model, _ = _filtered('swin_t', torch.float32, radius=4)
    runner = _Runner()
    GradFilterHook._log_cost(runner, model, get_gradient_filter_layers(model))
    text = '\n'.join(runner.logger.lines)
    assert 'linear 7x7 win' in text, text
    assert 'backbone.stages.3.blocks.0.ffn.layers.1' in text, text
    # the grid hooks are no state: checkpoints keep plain mmseg keys
    assert list(model.state_dict()) == plain_keys


@pytest.mark.parametrize('name', ['deit_s', 'beit_b'])
def test_a_deep_copy_filters_with_its_own_grids(name):
    """``copy.deepcopy`` (mmengine's EMA, tools copying a model) copies the
    grid hooks with the filtered layers (and BEiT's forward calling its
    ``qkv`` module): the copy's step filters (no exact-backward warning)
    and equals the original's."""
    import copy
    import warnings

    from mmseg_gf.models.gf_conv import GFExactBackwardWarning
    model, _ = _filtered(name, torch.float64, radius=2, lean=False)
    twin = copy.deepcopy(model)
    # the forwards the bindings replaced hold the copy's modules
    owners = [getattr(m.__dict__['forward'], 'attention', None) or
              m.__dict__['forward'].block
              for m in twin.modules() if 'forward' in m.__dict__]
    assert owners and set(owners) <= set(twin.modules())
    inputs, samples = _batch(model, torch.float64)
    want = _total_loss_step(model, inputs, samples)
    with warnings.catch_warnings():
        warnings.simplefilter('error', GFExactBackwardWarning)
        got = _total_loss_step(twin, inputs, samples)
    _close(got, want, 'deepcopy', 1e-12, 1e-14)


def test_a_budget_chooses_among_the_kinds_it_is_given():
    """A budget's pool is what ``num_layers`` counts: every kind by default
    (its predictions: tests/test_engine/test_token_kinds_accounting.py),
    the paper's convs with ``['conv2d']``; a bad kind fails by name."""
    assert check_settings(dict(budget=dict(saved_mib=1)))['layer_kinds'] \
        is None
    assert check_settings(dict(budget=dict(saved_mib=1),
                               layer_kinds=['conv2d', 'linear'])
                          )['layer_kinds'] == ['conv2d', 'linear']
    assert check_settings(dict(budget=dict(saved_mib=1),
                               layer_kinds=['conv2d']))['layer_kinds'] == \
        ['conv2d']
    with pytest.raises(ValueError, match=r"layer_kinds must be None"):
        check_settings(dict(budget=dict(saved_mib=1), layer_kinds=['fc']))


def test_linears_on_no_grid_are_not_counted_and_refused_by_name():
    """CGNet's global-context FCs act on pooled features: no token grid.
    ``num_layers`` counts around them (they stay frozen); naming one is
    refused by name."""
    from mmseg_gf.engine.build import build_segmentor
    from mmseg_gf.engine.zoo import family_config, make_offline
    model = build_segmentor(make_offline(family_config('cgnet')))
    choices = select_layers(model, num_layers=5, input_size=(SIZE, SIZE))
    assert {c.kind for c in choices} == {'conv2d'}
    with pytest.raises(ValueError, match=r'f_glo\.fc\.0.*no spatial grid'):
        select_layers(model, layers=['backbone.level2.20.f_glo.fc.0'],
                      input_size=(SIZE, SIZE))


def test_beit_qkv_and_dpt_readouts_are_selected_by_name_and_budget():
    """``layers=`` naming BEiT's last layer selects its four Linears, its
    ``qkv`` (mmseg computes it with ``F.linear`` on the weight) included,
    on the patch grid plus the cls token; naming DPT's reassemble blocks
    selects each readout projection on its input map's grid beside the
    convs; a budget's pool holds both."""
    from mmseg_gf.ops import TokenGrid
    beit = select_layers(tiny_model('beit_b'), layers=['backbone.layers.3'],
                         input_size=(SIZE, SIZE))
    assert [c.path for c in beit] == [
        f'backbone.layers.3.{name}' for name in (
            'attn.qkv', 'attn.proj', 'ffn.layers.0.0', 'ffn.layers.1')]
    assert {c.geometry.grid for c in beit} == {TokenGrid(4, 4, 1)}
    dpt = select_layers(tiny_model('dpt_vit_b'),
                        layers=['decode_head.reassemble_blocks'],
                        input_size=(SIZE, SIZE))
    readouts = [c for c in dpt if c.kind == 'linear']
    assert [c.path for c in readouts] == [
        f'decode_head.reassemble_blocks.readout_projects.{i}.0'
        for i in range(4)]
    assert {c.geometry.grid for c in readouts} == {TokenGrid(4, 4)}
    assert {c.kind for c in dpt} == {'linear', 'conv2d'}
    model = tiny_model('beit_b').float()
    chosen = select_and_apply(model, check_settings(
        dict(budget=dict(saved_mib=1))), (SIZE, SIZE))
    qkv = [c for c in chosen if c.path == 'backbone.layers.3.attn.qkv']
    assert qkv and isinstance(qkv[0].module, GFLinear)
