"""The optimizer's state in a budget's peaks, and the ``process_mib`` limit
(mmseg_gf.accounting.optimizer_state, mmseg_gf.engine.budget,
mmseg_gf.analysis.process_peak)."""
import json

import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402

from mmseg_gf.accounting.budget import (PEAK_HEADROOM,  # noqa: E402
                                        check_budget, choose_by_budget)
from mmseg_gf.accounting.batch import random_batch  # noqa: E402
from mmseg_gf.accounting.format import MIB  # noqa: E402
from mmseg_gf.accounting.optimizer_state import \
    optimizer_state_ratio  # noqa: E402
from mmseg_gf.analysis.process_peak import measure_process_peak  # noqa: E402
from mmseg_gf.engine.budget import (choose_layers_by_budget,  # noqa: E402
                                    process_base_bytes, profile_segmentor)
from mmseg_gf.engine.config import (build_grad_filter_model,  # noqa: E402
                                    check_settings, rewrite_config)
from mmseg_gf.engine.train_log import resident_bytes  # noqa: E402
from mmseg_gf.models.segmentor import set_frozen_norms_eval  # noqa: E402
from mmseg_gf.ops.backend import availability, extension, output_pool  # noqa: E402
from tests.helpers.engine_fixtures import (  # noqa: E402
    SMALL_BATCH, SMALL_SIZE, build_model, model_cfg)

SGD = dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=5e-4)
ADAMW = dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)


@pytest.mark.parametrize('optimizer, states', [
    (None, 0), (dict(type='SGD', lr=0.1), 0), (SGD, 1), (ADAMW, 2),
    (dict(type='Adam', lr=1e-3, amsgrad=True), 3)])
def test_optimizer_state_is_measured_per_parameter_byte(optimizer, states):
    # Adam's per-parameter step counter is a 4-byte tensor
    assert optimizer_state_ratio(optimizer) == pytest.approx(states,
                                                             abs=1e-4)


@pytest.mark.parametrize('budget, match', [
    (dict(process_mib=0), 'process_mib must be a positive number'),
    (dict(peak_mib=9, optimizer='AdamW'), "optimizer config with a 'type'"),
    (dict(peak_mib=9, optimizer=dict(lr=1)), "optimizer config with a"),
])
def test_bad_process_budgets_are_refused(budget, match):
    with pytest.raises(ValueError, match=match):
        check_budget(budget)
    with pytest.raises(ValueError, match='cannot be built'):
        optimizer_state_ratio(dict(type='NoSuchOptimizer'))


@pytest.fixture(scope='module')
def profile():
    torch.manual_seed(0)
    return profile_segmentor(build_model('pspnet_r18'), SMALL_SIZE,
                             timeline=True)


def test_peaks_count_the_trained_parameters_state(profile):
    plain = {n: profile.cost(n, 4, SMALL_BATCH) for n in (1, 6)}
    profile.optimizer_state_ratio = optimizer_state_ratio(ADAMW)
    profile.process_base_bytes = 100 * 2**20
    try:
        for n, without in plain.items():
            cost = profile.cost(n, 4, SMALL_BATCH)
            trained = sum(c.params for c in profile.convs[-n:]) + \
                profile.classifier_params
            assert cost.optimizer_bytes == pytest.approx(8 * trained,
                                                         rel=1e-4)
            assert cost.peak_bytes == without.peak_bytes + \
                cost.optimizer_bytes
            assert cost.process_bytes == 100 * 2**20 + cost.peak_bytes
            assert 'optimizer state' in cost.describe()
            assert 'process peak' in cost.describe()
        # a process limit: the most layers whose predicted peak fits
        limit = profile.cost(5, 8, SMALL_BATCH).process_mib / PEAK_HEADROOM
        choice = choose_by_budget(profile, dict(process_mib=limit * 1.0001),
                                  SMALL_BATCH)
        assert choice.num_layers >= 5
        assert choice.cost.process_mib <= limit
        if choice.num_layers < profile.max_layers:
            assert profile.cost(choice.num_layers + 1, 8,
                                SMALL_BATCH).process_mib > limit
    finally:
        profile.optimizer_state_ratio = 0.0
        profile.process_base_bytes = None


@pytest.fixture
def kernel_pool_restored():
    """A process_mib budget switches the compiled kernels' output pool off
    process-wide; the other tests of this process get their limit back."""
    if not extension.built():
        yield
        return
    previous = output_pool.recycle_limit(output_pool.recycle_limit(0))
    try:
        yield
    finally:
        output_pool.recycle_limit(previous)


def test_process_base_is_the_resident_memory_less_the_probe(
        kernel_pool_restored):
    model = build_model('pspnet_r18')
    tensors = sum(t.numel() * t.element_size() for t in
                  list(model.parameters()) + list(model.buffers()))
    base = process_base_bytes(model)
    if torch.cuda.is_available():
        assert base == tensors
        return
    assert base is not None
    assert abs(base + tensors - resident_bytes()) < 16 * 2**20
    choice = choose_layers_by_budget(
        model, dict(process_mib=base / MIB + 400, optimizer=SGD),
        SMALL_SIZE, SMALL_BATCH)
    assert choice.cost.optimizer_bytes > 0
    assert choice.cost.process_bytes > choice.cost.peak_bytes
    with pytest.raises(ValueError, match='reuse_cpu_memory'):
        check_settings(dict(budget=dict(process_mib=900),
                            reuse_cpu_memory=True))


def test_the_config_rewrite_passes_the_configs_optimizer():
    cfg = Config(dict(model=model_cfg('pspnet_r18'),
                      optim_wrapper=dict(type='OptimWrapper', optimizer=SGD),
                      gradient_filter=dict(budget=dict(process_mib=900))))
    rewrite_config(cfg)
    assert cfg.model.budget['optimizer'] == SGD
    rewrite_config(cfg)  # the dumped config's check agrees


def test_measured_process_peak_is_within_10_percent(tmp_path):
    """The whole path in a fresh process: config, budget, optimizer wrapper,
    three training steps; ``VmHWM`` against the prediction (at this tiny
    size the process's base dominates both)."""
    cfg = Config(dict(model=model_cfg('pspnet_r18'),
                      optim_wrapper=dict(type='OptimWrapper', optimizer=SGD)))
    path = tmp_path / 'pspnet_r18_tiny.py'
    cfg.dump(str(path))
    result = measure_process_peak(str(path), (128, 128), 2,
                                  dict(process_mib=100000), steps=2,
                                  threads=1)
    predicted = result['predicted_process_mib']
    measured = result['measured_process_mib']
    assert abs(measured / predicted - 1) <= 0.10, json.dumps(result)
    assert result['kernel_pool_mib'] in (None, 0), json.dumps(result)


@pytest.mark.skipif(not availability.native_available() or torch.cuda.is_available(),
                    reason='the compiled CPU kernels are not in use')
def test_a_process_budget_keeps_no_freed_kernel_outputs(
        kernel_pool_restored):
    """The kernels' output pool keeps the large outputs one backward frees
    for the next step: memory that is no step's live tensor, so the
    prediction does not count it (on Swin-T UPerNet at 256x256 it held
    142 MiB and put the process 13.6% over its prediction). A
    ``process_mib`` budget switches it off; trained steps then leave
    nothing in it."""
    output_pool.recycle_limit(256 << 20)
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = build_grad_filter_model(
        model_cfg('pspnet_r18'), input_size=SMALL_SIZE,
        budget=dict(process_mib=100000, batch=SMALL_BATCH, optimizer=SGD))
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.01,
        momentum=0.9)
    for _ in range(2):
        inputs, samples = random_batch(model, SMALL_SIZE, SMALL_BATCH)
        model.train()
        set_frozen_norms_eval(model)
        loss, _ = model.parse_losses(model.loss(inputs, samples))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert output_pool.recycled_bytes() == 0
    assert output_pool.recycle_limit(0) == 0
