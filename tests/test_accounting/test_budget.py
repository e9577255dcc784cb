"""Choosing layers and radii from a budget (mmseg_gf.engine.budget).

The profile's costs are checked against independent counts of the model
actually built with each setting: the lean step's saved bytes as autograd
keeps them, and the backward FLOPs of the cost model over the traced convs.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from tests.helpers.devices import DEVICES  # noqa: E402
from tests.helpers.engine_fixtures import (  # noqa: E402
    SIX_MODELS, SMALL_BATCH, SMALL_SIZE, build_model, filtered_copy,
    step_saved_bytes)

from mmseg_gf.accounting.budget import (DEFAULT_RADII,  # noqa: E402
                                        PEAK_HEADROOM, check_budget,
                                        choose_by_budget)
from mmseg_gf.analysis.budget_sweep import measured_step_peak  # noqa: E402
from mmseg_gf.analysis.model_cost import model_backward_cost  # noqa: E402
from mmseg_gf.engine import get_state  # noqa: E402
from mmseg_gf.engine.budget import profile_segmentor  # noqa: E402
from mmseg_gf.engine.config import check_settings  # noqa: E402

MODELS, SIZE, BATCH = SIX_MODELS, SMALL_SIZE, SMALL_BATCH


@pytest.mark.parametrize('budget, match', [
    (300, 'must be a dict'),
    (dict(saved=3), "unknown key.*'saved'"),
    (dict(radii=[2, 4]), 'at least one limit'),
    (dict(saved_mib=0), 'saved_mib must be a positive number'),
    (dict(peak_mib=True), 'peak_mib must be a positive number'),
    (dict(backward_gflops='1'), 'backward_gflops must be a positive'),
    (dict(saved_mib=1, radii=[]), 'radii must be a non-empty list'),
    (dict(saved_mib=1, radii=[0, 2]), 'radii must be a non-empty list'),
    (dict(saved_mib=1, batch=0), 'batch must be an int >= 1'),
])
def test_bad_budgets_are_refused_with_what_is_allowed(budget, match):
    with pytest.raises(ValueError, match=match):
        check_budget(budget)


def test_budget_defaults():
    out = check_budget(dict(saved_mib=10, radii=[8, 2, 8]))
    assert out['radii'] == (2, 8)
    assert check_budget(dict(peak_mib=1))['radii'] == DEFAULT_RADII
    assert out['batch'] is None and out['backward_gflops'] is None


@pytest.mark.parametrize('settings, match', [
    (dict(budget=dict(saved_mib=1), num_layers=5), 'exactly one of'),
    (dict(budget=dict(saved_mib=1), radius=4), 'chooses the radii itself'),
    (dict(budget=dict(saved_mib=1), mode='vanilla'), "needs mode='gf'"),
    (dict(budget=dict(saved_mib=1), train_norm=True), "needs mode='gf'"),
])
def test_settings_with_a_budget_are_checked(settings, match):
    with pytest.raises(ValueError, match=match):
        check_settings(settings)
    ok = check_settings(dict(budget=dict(saved_mib=1)))
    assert ok['radius'] is None and ok['budget']['saved_mib'] == 1


def _flops_per_image(model):
    cost = model_backward_cost(model, SIZE, batch=1)
    return cost.flops + cost.classifier.cost.vanilla_flops


@pytest.mark.parametrize('name', MODELS)
def test_profile_costs_equal_the_built_models(name):
    """For several N and radius assignments: the profile's saved bytes ==
    autograd's saved bytes of the model built that way, and its backward
    FLOPs == the cost model over that model's traced convs."""
    torch.manual_seed(0)
    base = build_model(name)
    profile = profile_segmentor(base, SIZE)
    n_all = profile.max_layers
    assert n_all == len([p for p in profile.convs])
    settings = [(1, 2), (5, 8), (min(12, n_all), 4)]
    # mixed radii: every other trained conv at 2, the rest at 8
    n_mixed = min(7, n_all)
    paths = [c.path for c in profile.convs[n_all - n_mixed:]]
    settings.append((n_mixed, {p: (2 if i % 2 else 8)
                               for i, p in enumerate(paths)}))
    for n, radius in settings:
        predicted = profile.cost(n, radius, BATCH)
        model = filtered_copy(base, n, radius, SIZE)
        measured = step_saved_bytes(model, SIZE, BATCH)
        assert predicted.saved_bytes == measured, (n, radius)
        assert predicted.backward_flops == _flops_per_image(model), (n,
                                                                     radius)
        assert profile.unmodelled(n) == []


def test_choice_takes_most_layers_then_finest_radii():
    torch.manual_seed(0)
    profile = profile_segmentor(build_model('pspnet_r18'), SIZE)
    radii = (2, 4, 8)
    limit = profile.cost(9, 8, BATCH).saved_mib * 1.02
    choice = choose_by_budget(profile, dict(saved_mib=limit, radii=radii),
                              BATCH)
    assert choice.cost.saved_mib <= limit
    n = choice.num_layers
    assert n >= 9
    if n < profile.max_layers:
        assert profile.cost(n + 1, 8, BATCH).saved_mib > limit
    # no single radius can be made finer within the limit
    for path, r in choice.radius.items():
        if r == radii[0]:
            continue
        finer = radii[radii.index(r) - 1]
        trial = dict(choice.radius, **{path: finer})
        assert profile.cost(n, trial, BATCH).saved_mib > limit, path
    # a FLOPs limit alone: the same rules on the other figure
    gflops = profile.cost(6, 4, BATCH).backward_gflops
    choice = choose_by_budget(profile, dict(backward_gflops=gflops), BATCH)
    assert choice.cost.backward_gflops <= gflops
    assert choice.num_layers >= 6


def test_unmeetable_budget_names_the_cheapest_setting():
    torch.manual_seed(0)
    profile = profile_segmentor(build_model('fcn_r18'), SIZE)
    cheapest = profile.cost(1, 8, BATCH)
    with pytest.raises(ValueError) as err:
        choose_by_budget(profile, dict(saved_mib=cheapest.saved_mib / 2),
                         BATCH)
    message = str(err.value)
    assert 'cannot be met' in message
    assert f'{cheapest.saved_mib:.1f} MiB kept for backward' in message


PEAK_SIZE = (128, 128)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('name', MODELS)
def test_predicted_peak_holds_for_the_chosen_setting(name, device):
    """A peak budget: the chosen setting's measured step peak is within 10%
    of the prediction and within the budget (CPU: live tensor bytes from
    the profiler; CUDA: ``max_memory_allocated``)."""
    torch.manual_seed(0)
    base = build_model(name)
    profile = profile_segmentor(base, PEAK_SIZE, timeline=True)
    n = min(8, profile.max_layers)
    limit = profile.cost(n, 8, BATCH).peak_mib / PEAK_HEADROOM * 1.0001
    choice = choose_by_budget(profile, dict(peak_mib=limit), BATCH)
    assert choice.num_layers >= n
    predicted = choice.cost.peak_bytes
    model = filtered_copy(base, choice.num_layers, choice.radius,
                          PEAK_SIZE).to(device)
    measured = measured_step_peak(model, PEAK_SIZE, BATCH, device)
    assert abs(measured / predicted - 1) <= 0.10, (measured, predicted)
    assert measured / 2**20 <= limit, (measured, limit)


# ----------------------------------------------------------------------------
# The two ways in: config rewrite and GradFilterHook, at the config's batch


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    from tests.helpers.engine_fixtures import prepare_workspace
    return prepare_workspace(str(tmp_path_factory.mktemp('gf_budget')))


@pytest.mark.parametrize('way', ['rewrite', 'hook'])
def test_budget_runs_train_the_chosen_layers(workspace, way):
    """Both ways in pick, at the config's crop and batch size, what
    choose_by_budget picks on a fresh profile, train exactly those layers
    at their radii and log the choice."""
    import os.path as osp

    from mmseg_gf.models import GFConv2d
    from tests.helpers.engine_fixtures import (
        changed_modules, run_training, tool_cfg)
    batch = 2
    torch.manual_seed(0)
    profile = profile_segmentor(build_model('pspnet_r18'), SIZE)
    limit = profile.cost(8, 8, batch).saved_mib * 1.01
    budget = dict(saved_mib=limit, radii=[2, 8])
    expected = choose_by_budget(profile, budget, batch)
    cfg = tool_cfg(osp.join(workspace['root'], way), workspace['voc'],
                   workspace['init'], way=way, max_iters=2,
                   batch_size=batch)
    if way == 'rewrite':
        cfg['gradient_filter'] = dict(budget=budget)
    else:
        cfg['custom_hooks'] = [dict(type='GradFilterHook', budget=budget)]
    runner = run_training(cfg)
    model = runner.model
    radii = {n: m.radius for n, m in model.named_modules()
             if isinstance(m, GFConv2d)}
    assert radii == expected.radius
    trained = set(radii) | {'decode_head.conv_seg'}
    assert changed_modules(model.state_dict(),
                           workspace['init_state']) == trained
    log = open(osp.join(runner.log_dir, f'{runner.timestamp}.log')).read()
    assert f'the last {expected.num_layers} convs' in log
    assert 'MiB kept for backward' in log


def test_pipeline_budget_strategy_spends_the_compute_of_gf_last5_r4():
    """gf_budget5_r8 gets the predicted backward GFLOPs of gf_last5_r4 at
    the run's crop and trains more layers at r = 8 within them."""
    from mmseg_gf.engine.build import build_segmentor
    from mmseg_gf.protocol import compose_config
    from mmseg_gf.protocol.run_config import fill_budget, set_data
    cfg = compose_config('pspnet_r18', 'voc', 'gf_budget5_r8')
    set_data(cfg, crop=SIZE)
    assert cfg.gradient_filter.budget.backward_gflops is None
    fill_budget(cfg, 'gf_budget5_r8', 'pspnet_r18')
    limit = cfg.gradient_filter.budget.backward_gflops
    reference = compose_config('pspnet_r18', 'voc', 'gf_last5_r4')
    set_data(reference, crop=SIZE)
    torch.manual_seed(0)
    ref_model = build_segmentor(reference)
    assert limit == pytest.approx(_flops_per_image(ref_model) / 1e9,
                                  rel=1e-6)
    torch.manual_seed(0)
    model = build_segmentor(cfg)
    choice = get_state(model).budget
    assert choice.num_layers > 5
    assert set(choice.radius.values()) == {8}
    assert _flops_per_image(model) / 1e9 <= limit
