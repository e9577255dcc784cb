"""GELUs between two filtered layers keep the patch means of their
derivative where the traced training step shows it exact
(docs/gradient_filter.md#elementwise-ops-between-filtered-layers).

Tiny zoo models (tests/helpers/token_families.py), 64x64, batch 2,
``num_layers=20`` (Linears counted; 10 on the tiny Segmenter), r = 4,
through the config path
(``check_settings`` -> ``select_and_apply``):

* the rule is installed on exactly the GELUs of the MLPs whose two filtered
  neighbours were chosen (Segformer's Mix-FFN; Swin's, Twins', DeiT's and
  Segmenter's FFN, with a cls token or trailing class embeddings), and
  runs there in a step;
* it is not installed where a premise fails: the layer before the GELU
  frozen (``num_layers=19`` on DeiT leaves its first chosen MLP's fc1 out),
  a dropout with ``p > 0`` between the GELU and the layer after it;
* the step with the rule equals the step without it (float64, rtol 1e-10)
  and the step with ``lean=False`` (float32; loss and gradients rtol 1e-4,
  gradients atol 1e-5 of the largest element, as
  tests/test_engine/test_transformer_selection.py: the lean step's
  attentions, filtered ones included, sum through SDPA in another order
  than the plain step's ``bmm``);
* autograd's saved bytes drop by what the GELUs' inputs held less their
  patch means, and the step trace counts the GELUs by rule (none
  unmodelled) and drops by as much.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.accounting.batch import training_loss  # noqa: E402
from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.engine.config import (check_settings,  # noqa: E402
                                    patch_means_on, select_and_apply)
from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from mmseg_gf.engine.state import get_state  # noqa: E402
from mmseg_gf.models.patch_mean_gelu import (  # noqa: E402
    is_patch_mean_gelu, patch_mean_partition)
from mmseg_gf.ops.linear.patch_mean_activation import patch_mean_kept_elements  # noqa: E402
from tests.test_engine.test_transformer_selection import (  # noqa: E402
    _batch, _close, _total_loss_step)
from tests.helpers.token_families import SIZE, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')

#: family -> the GELUs whose MLP has both neighbours among the last 20.
EXPECTED = {
    'segformer_b0': [f'backbone.layers.{i}.1.0.ffn.activate'
                     for i in (1, 2, 3)],
    'swin_t': [f'backbone.stages.{i}.blocks.0.ffn.layers.0.1'
               for i in (2, 3)],
    'deit_s': [f'backbone.layers.{i}.ffn.layers.0.1' for i in (1, 2, 3)],
    'twins_pcpvt_s': [f'backbone.layers.{i}.0.ffn.layers.0.1'
                      for i in (2, 3)],
    # the mask head's FFN too: its tokens end with the class embeddings
    'segmenter_vit_t': ['backbone.layers.0.ffn.layers.0.1',
                        'backbone.layers.1.ffn.layers.0.1',
                        'decode_head.layers.0.ffn.layers.0.1'],
}
#: layers counted (the tiny Segmenter has 11 besides its classifier).
NUM_LAYERS = dict(segmenter_vit_t=10)


def _model(name, dtype, num_layers=None, edit=None, **settings):
    num_layers = num_layers or NUM_LAYERS.get(name, 20)
    model = tiny_model(name).to(dtype)
    if edit is not None:
        edit(model)
    settings = check_settings(dict(num_layers=num_layers, radius=4,
                                   **settings))
    select_and_apply(model, settings, (SIZE, SIZE))
    return model


def _gelus(model):
    return sorted(p for p, m in model.named_modules()
                  if is_patch_mean_gelu(m))


@pytest.mark.parametrize('name', list(EXPECTED))
def test_rule_fires_on_the_last_mlps_and_changes_no_gradient(name):
    on = _model(name, torch.float64)
    assert get_state(on).patch_mean_gelus == EXPECTED[name]
    assert _gelus(on) == EXPECTED[name]
    assert lean_counts(on)['patch_mean_gelu'] == len(EXPECTED[name])
    off = _model(name, torch.float64, patch_mean_activations=False)
    assert _gelus(off) == [] and get_state(off).patch_mean_gelus == []
    inputs, samples = _batch(on, torch.float64)
    got = _total_loss_step(on, inputs, samples)
    for path in EXPECTED[name]:  # the rule ran in that step
        assert on.get_submodule(path)._gf_patch_mean_call is not None, path
    _close(got, _total_loss_step(off, inputs, samples), f'{name} rule off', 1e-10,
           1e-12)

    lean = _model(name, torch.float32)
    plain = _model(name, torch.float32, lean=False)
    assert _gelus(lean) == EXPECTED[name] and _gelus(plain) == []
    inputs = inputs.float()
    # (lean: the trained attentions run SDPA, which sums in another order
    # than the bmm path of lean=False: float32 rounding, not the rule,
    # which the float64 comparison above checks to 1e-10)
    _close(_total_loss_step(lean, inputs, samples), _total_loss_step(plain, inputs, samples),
           f'{name} lean', 1e-4, 1e-5)


def test_not_installed_where_a_premise_fails():
    # fc1 of backbone.layers.1's MLP is not among the last 19: the GELU's
    # input is no filtered layer's output
    model = _model('deit_s', torch.float64, num_layers=19)
    assert _gelus(model) == EXPECTED['deit_s'][1:]

    def dropout_after_gelu(m):  # a mask between the GELU and fc2
        m.backbone.layers[3].ffn.layers[0][2].p = 0.1

    model = _model('deit_s', torch.float64, edit=dropout_after_gelu)
    assert _gelus(model) == EXPECTED['deit_s'][:2]
    # vanilla and lean=False: never
    assert _gelus(_model('deit_s', torch.float64, mode='vanilla')) == []


@pytest.mark.parametrize('name', ['segformer_b0', 'deit_s', 'segmenter_vit_t'])
def test_saved_bytes_drop_by_the_gelus_inputs_less_their_patch_means(name):
    on = _model(name, torch.float32)
    off = _model(name, torch.float32, patch_mean_activations=False)
    inputs, samples = _batch(on, torch.float32)
    measured_on = saved_tensor_bytes(
        lambda: training_loss(on, inputs, samples))
    measured_off = saved_tensor_bytes(
        lambda: training_loss(off, inputs, samples))
    drop = 0
    for path in EXPECTED[name]:
        gelu = on.get_submodule(path)
        shape = gelu._gf_patch_mean_call
        kept = patch_mean_kept_elements(shape, patch_mean_partition(gelu))
        numel = 1
        for s in shape:
            numel *= s
        drop += (numel - kept) * 4
    assert drop > 0 and measured_off - measured_on == drop
    counted = trace_step_saved_bytes(on, (SIZE, SIZE))
    assert not any('GELU' in kind for kind in counted.unmodelled_bytes(2)), \
        counted.summary(2)
    # the count drops by as much (trained GFLinear / GFMultiheadAttention
    # are measured, not counted by rule, in both; with convs only,
    # tests/test_engine/test_lean_transformer_families.py finds the count
    # equal to autograd's bytes with these GELUs on)
    counted_off = trace_step_saved_bytes(off, (SIZE, SIZE))
    assert counted_off.total(2) - counted.total(2) == drop


def test_the_traced_step_leaves_no_trace():
    """Training flags, BN statistics of trained norms (with
    ``train_norm``), the random number generator and the record of frozen
    auxiliary heads logged are as they were after the traced step."""
    tiny_model('swin_t')  # built (and seeded) once, before the check
    rng = torch.get_rng_state()
    on = _model('swin_t', torch.float64, train_norm=True)
    assert torch.equal(torch.get_rng_state(), rng)
    off = _model('swin_t', torch.float64, train_norm=True,
                 patch_mean_activations=False)
    assert _gelus(on)
    assert [m.training for m in on.modules()] == [
        m.training for m in off.modules()]
    buffers = dict(off.named_buffers())
    for name, buffer in on.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    # the head's 12 convs: the frozen FCN auxiliary head is skipped in
    # steps and logged at the first one, not by the trace
    head_only = _model('swin_t', torch.float64, num_layers=12)
    assert get_state(head_only).logged_frozen_aux_heads == set()
    inputs, samples = _batch(head_only, torch.float64)
    _total_loss_step(head_only, inputs, samples)
    assert get_state(head_only).logged_frozen_aux_heads == {
        'auxiliary_head'}


def test_the_budget_models_the_rule_where_the_settings_apply_it():
    """The budget's profile models the rule exactly when the trained step
    applies it: lean, ``mode='gf'``, ``patch_mean_activations``."""
    assert patch_means_on(None) and patch_means_on({})
    assert patch_means_on(dict(lean=True, mode='gf',
                               patch_mean_activations=True))
    assert not patch_means_on(dict(patch_mean_activations=False))
    assert not patch_means_on(dict(lean=False))
    assert not patch_means_on(dict(mode='vanilla'))
