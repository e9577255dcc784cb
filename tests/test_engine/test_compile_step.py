"""``torch.compile`` of a lean GF training step (PSPNet-R18, last 10 convs,
r = 4, the pyramid pooling module's included; a tiny Segformer-B0 with
every layer kind): no graph break of the plugin's own (the plain model's
come from mmseg's dynamic-shape code), the eager loss and gradients, and
mmengine's ``compile=True`` training the demo's setting through the hook
and the config rewrite (docs/lean_region.md#torchcompile).

Most cases use ``aot_eager`` (Dynamo and AOTAutograd, no code
generation); one runs Inductor's C++ backend.
"""
import copy
from contextlib import nullcontext
from unittest import mock

import pytest
import torch

pytest.importorskip('mmseg')

from tests.helpers.devices import needs_cuda  # noqa: E402
from tests.helpers.engine_fixtures import (  # noqa: E402
    SMALL_BATCH, SMALL_SIZE, build_model, prepare_workspace, run_training,
    tool_cfg)

from mmseg_gf.accounting.batch import random_batch  # noqa: E402
from mmseg_gf.engine import apply_gradient_filter, select_layers  # noqa: E402
from mmseg_gf.engine.compile_settings import compile_setting  # noqa: E402
from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from mmseg_gf.models.segmentor import set_frozen_norms_eval  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')


def _lean_gf(base):
    model = copy.deepcopy(base)
    choices = select_layers(model, num_layers=10, radius=4,
                            input_size=SMALL_SIZE)
    apply_gradient_filter(model, choices, mode='gf', lean=True)
    return model


@pytest.fixture(scope='module')
def models():
    torch.manual_seed(0)
    plain = build_model('pspnet_r18')
    inputs, samples = random_batch(plain, SMALL_SIZE, SMALL_BATCH,
                                   label_block=4)
    return plain, _lean_gf(plain), inputs, samples


def _training(model):
    model.train()
    set_frozen_norms_eval(model)
    return model


def _own_breaks(explanation):
    """Graph breaks whose innermost frame is the plugin's code."""
    return [str(r.reason).splitlines()[0] for r in
            explanation.break_reasons if r.user_stack and
            'mmseg_gf' in r.user_stack[-1].filename]


def test_lean_step_breaks_no_more_than_plain(models):
    plain, lean, inputs, samples = models
    counts = lean_counts(lean)
    assert counts.get('loss') and counts.get('activation'), counts
    torch._dynamo.reset()
    want = torch._dynamo.explain(_training(plain).loss)(inputs, samples)
    torch._dynamo.reset()
    got = torch._dynamo.explain(_training(lean).loss)(inputs, samples)
    assert not _own_breaks(got), _own_breaks(got)
    assert got.graph_break_count <= want.graph_break_count, (
        got.break_reasons, want.break_reasons)


def _loss_and_grads(model, loss, inputs, samples):
    _training(model).zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the head's dropout draws the same noise
    terms = loss(inputs, samples)
    total = sum(v.sum() for k, v in terms.items() if 'loss' in k)
    total.backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters()
                            if p.requires_grad}


def _assert_close_step(got, got_grads, want, want_grads, rtol, label):
    """Loss within ``rtol``, every gradient within ``10 * rtol`` (and
    ``rtol`` of its largest entry)."""
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol / 10)
    assert set(got_grads) == set(want_grads) and want_grads
    for name, g in want_grads.items():
        torch.testing.assert_close(
            got_grads[name], g, rtol=10 * rtol,
            atol=rtol * float(g.abs().max()),
            msg=lambda m: f'{label} {name}: {m}')


@pytest.mark.parametrize('backend, setting', [
    ('aot_eager', dict(backend='aot_eager')),
    # as GradFilterHook has mmengine compile a lean model on CPU (the
    # layout optimization off), and with Inductor's defaults (channels-last
    # convolutions; what a setting naming a mode gets)
    ('inductor', compile_setting(True, 'cpu', True)),
    ('inductor', dict(options=dict(layout_optimization=True)))],
    ids=['aot_eager', 'inductor', 'inductor_channels_last'])
def test_compiled_lean_step_equals_eager(models, backend, setting):
    """Inductor draws its own random numbers unless told to fall back to
    torch's (``fallback_random``: the dropout's noise as eager draws it)."""
    _, lean, inputs, samples = models
    want, want_grads = _loss_and_grads(lean, lean.loss, inputs, samples)
    torch._dynamo.reset()
    config = mock.patch.object(torch._inductor.config, 'fallback_random',
                               True) if backend == 'inductor' else \
        nullcontext()
    with config:
        got, got_grads = _loss_and_grads(
            lean, torch.compile(lean.loss, **setting), inputs, samples)
    _assert_close_step(got, got_grads, want, want_grads, 1e-5, backend)


def _traced_tiny_family(name: str):
    """A tiny zoo model of the transformer tests with every layer kind in
    its last 20 filtered, lean: checks that it traces with no graph break
    of the plugin's own and no more than the plain model's; returns it and
    a batch."""
    from tests.test_engine.test_lean_transformer_families import (
        BATCH, SIZE, _model, tiny_cfg)
    from tests.helpers.lean_steps import plain_model
    cfg = tiny_cfg(name)
    plain = plain_model(cfg)
    lean = _model(cfg, plain, 'gf', True, 20, layer_kinds=None)
    inputs, samples = random_batch(plain, (SIZE, SIZE), BATCH,
                                   label_block=4)
    torch._dynamo.reset()
    got = torch._dynamo.explain(_training(lean).loss)(inputs, samples)
    assert not _own_breaks(got), _own_breaks(got)
    if got.graph_break_count:  # none: no more than the plain model's
        torch._dynamo.reset()
        want = torch._dynamo.explain(_training(plain).loss)(inputs, samples)
        assert got.graph_break_count <= want.graph_break_count
    return lean, inputs, samples


def test_lean_segformer_traces_and_equals_eager():
    """A tiny Segformer-B0 with every layer kind filtered (Linears and
    attentions on token grids, patch-mean GELUs): no graph break of the
    plugin's own, no more than the plain model's, eager's loss and
    gradients under ``aot_eager``."""
    lean, inputs, samples = _traced_tiny_family('segformer_b0')
    want, want_grads = _loss_and_grads(lean, lean.loss, inputs, samples)
    torch._dynamo.reset()
    got, got_grads = _loss_and_grads(
        lean, torch.compile(lean.loss, backend='aot_eager'), inputs, samples)
    _assert_close_step(got, got_grads, want, want_grads, 1e-5, 'segformer')


def test_lean_swin_traces_with_no_break_of_its_own():
    """A tiny Swin-T UPerNet with every layer kind in its last 20 filtered
    (window attention through SDPA, lean LayerNorms, filtered Linears): one
    graph where the plain model takes four (its window attention's
    accounting record reads no storage address while compiling)."""
    _traced_tiny_family('swin_t')


@pytest.mark.parametrize('way, setting', [
    ('rewrite', dict(backend='aot_eager')),
    ('hook', dict(backend='aot_eager')),
    # Inductor with a CUDA setting, accepted on CPU (no CUDA graphs there)
    # and passed on (the options the hook adds to compile=True: the unit
    # tests and test_compiled_lean_step_equals_eager[inductor])
    ('rewrite', dict(mode='reduce-overhead'))],
    ids=['rewrite-aot_eager', 'hook-aot_eager', 'rewrite-reduce-overhead'])
def test_runner_compile_trains_like_eager(tmp_path, way, setting):
    """mmengine's ``compile=...`` (``GradFilterHook`` takes it over and
    compiles the segmentor's loss after its surgery, before the first
    step) trains to the eager run's weights."""
    work = prepare_workspace(str(tmp_path))
    weights = []
    for compile_cfg in (None, setting):
        torch._dynamo.reset()
        cfg = tool_cfg(str(tmp_path / f'{way}_{bool(compile_cfg)}'),
                       work['voc'], work['init'], way=way, max_iters=2)
        extra = {} if compile_cfg is None else dict(compile=compile_cfg)
        # Inductor draws the dropout's noise as eager mode does
        with mock.patch.object(torch._inductor.config, 'fallback_random',
                               True):
            runner = run_training(cfg, **extra)
        if compile_cfg is not None:
            [hook] = [h for h in runner.hooks
                      if type(h).__name__ == 'GradFilterHook']
            want = dict(setting) if isinstance(setting, dict) else \
                compile_setting(True, 'cpu', True)
            assert hook._compile == dict(want, dynamic=False)
            assert runner.cfg.compile is False  # the Runner compiled nothing
        weights.append({k: v.detach().clone() for k, v in
                        runner.model.state_dict().items()})
    eager, compiled = weights
    assert set(eager) == set(compiled)
    changed = [k for k in eager if not torch.equal(eager[k],
                                                   work['init_state'][k])]
    assert changed, 'nothing trained'
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4,
                                   atol=1e-6, msg=lambda m: f'{key}: {m}')


@pytest.mark.cuda
@needs_cuda
def test_compiled_lean_step_equals_eager_on_cuda(models):
    """Inductor's CUDA backend (Triton code generated around the plugin's
    operators) gives eager's loss and gradients."""
    _, lean, inputs, samples = models
    lean = copy.deepcopy(lean).cuda()
    inputs = inputs.cuda()
    samples = [s.to('cuda') for s in samples]
    want, want_grads = _loss_and_grads(lean, lean.loss, inputs, samples)
    torch._dynamo.reset()
    with mock.patch.object(torch._inductor.config, 'fallback_random', True):
        got, got_grads = _loss_and_grads(
            lean, torch.compile(lean.loss), inputs, samples)
    # Inductor's generated CUDA kernels round their fused sums their own way
    _assert_close_step(got, got_grads, want, want_grads, 1e-4, 'cuda')
