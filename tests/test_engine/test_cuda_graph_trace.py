"""``torch.compile`` of a lean loss on the path CUDA tensors take, checked
as Inductor's CUDA-graph tree checks a graph before capturing it: one
graph, no mutated input besides parameters and buffers (static inputs),
and the eager step's loss and gradients (float32). Where the plain model
is more than one graph, the lean one has no more graphs or breaks. The
four models of the launch targets: PSPNet-R18 last 10, BiSeNetV2,
Segformer-B0 and Swin-T UPerNet last 20 (every layer kind), lean GF r=4.

On CPU tensors with the compiled kernels off (``MMSEG_GF_NATIVE=0``) and
:func:`~mmseg_gf.ops.backend.device_path.as_on_cuda` (what a CUDA tensor
decides; in this process triton runs no kernel on CPU tensors, as on a GPU
with ``MMSEG_GF_TRITON=0``: the lean loss then traces as PyTorch
operators). The Triton kernel's operator under ``torch.compile`` is
checked in ``tests/helpers/triton_loss_cases.py``. The backend runs
AOTAutograd without code generation and reads its functionalization
metadata (``ViewAndMutationMeta``): the mutated inputs
(``mutated_inp_runtime_indices``, and every input whose data or metadata
a graph mutates) against the static ones (``static_input_indices``).
"""
import copy
from typing import Dict, List

import pytest
import torch

pytest.importorskip('mmseg')

from mmseg_gf.accounting.batch import random_batch  # noqa: E402
from mmseg_gf.engine import apply_gradient_filter, select_layers  # noqa: E402
from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from mmseg_gf.models.segmentor import set_frozen_norms_eval  # noqa: E402
from mmseg_gf.ops.backend.device_path import as_on_cuda  # noqa: E402
from tests.helpers.devices import kernels_off  # noqa: E402

pytestmark = pytest.mark.usefixtures('one_thread')

SIZE = 32


def _recording_backend(graphs: List[Dict]):
    """AOTAutograd without code generation; each forward graph appends
    its mutated non-static inputs to ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward(gm, example_inputs):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        mutated = set(meta.mutated_inp_runtime_indices) | {
            i for i, info in enumerate(meta.input_info)
            if info.mutates_data or info.mutates_metadata}
        graphs.append(dict(
            mutated_non_static=sorted(
                mutated - set(meta.static_input_indices)),
            inputs=len(meta.input_info)))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward,
                        bw_compiler=lambda gm, _: make_boxed_func(gm.forward))


def _step(model, loss, inputs, samples):
    model.train()
    set_frozen_norms_eval(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # dropout draws the same noise
    terms = loss(inputs, samples)
    total = sum(v.sum() for k, v in terms.items() if 'loss' in k)
    total.backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters()
                            if p.grad is not None}


def _compiled_step(model, inputs, samples):
    """The step with ``model.loss`` compiled by the recording backend:
    ``(loss, gradients), graphs, graph breaks``."""
    from torch._dynamo.utils import counters
    graphs: List[Dict] = []
    torch._dynamo.reset()
    counters.clear()
    got = _step(model, torch.compile(model.loss,
                                     backend=_recording_backend(graphs)),
                inputs, samples)
    return got, graphs, sum(counters['graph_break'].values())


def _pspnet_r18():
    from tests.helpers.engine_fixtures import build_model
    torch.manual_seed(0)
    plain = build_model('pspnet_r18')
    lean = copy.deepcopy(plain)
    choices = select_layers(lean, num_layers=10, radius=4,
                            input_size=(SIZE, SIZE))
    apply_gradient_filter(lean, choices, mode='gf', lean=True)
    return plain, lean


def _token_family(name: str):
    """The shrunk zoo config, every layer kind filtered in the last 20."""
    from tests.helpers.lean_steps import plain_model
    from tests.test_engine.test_lean_transformer_families import (_model,
                                                                  tiny_cfg)
    cfg = tiny_cfg(name)
    plain = plain_model(cfg)
    return plain, _model(cfg, plain, 'gf', True, 20, layer_kinds=None)


def _bisenetv2():
    from mmseg_gf.engine.build import build_segmentor
    from tests.helpers.lean_steps import plain_model
    from tests.test_engine.test_realtime_families import family_cfg
    cfg = family_cfg('bisenetv2', 64)
    plain = plain_model(cfg)
    cfg.gradient_filter = dict(num_layers=20, radius=4, mode='gf', lean=True)
    lean = build_segmentor(cfg)
    lean.load_state_dict(plain.state_dict())
    return plain, lean


#: name -> (builder of (plain, lean), input size, batch). PSPNet at batch
#: 2: the plain model trains the pyramid's batch norms, which refuse a
#: 1 x 1 map of one image. The token families at batch 1: a CPU
#: convolution of one channels-last image returns a contiguous output
#: where the traced one is channels-last, which a traced view of it meets.
MODELS = {'pspnet_r18': (_pspnet_r18, SIZE, 2),
          'bisenetv2': (_bisenetv2, 64, 1),
          'segformer_b0': (lambda: _token_family('segformer_b0'), SIZE, 1),
          'swin_t': (lambda: _token_family('swin_t'), SIZE, 1)}

# Seconds of one case (pytest, one process, three runs on a 2-core AMD EPYC
# VM shared at a load average of 3.7-6): PSPNet-R18 10-24 (with the first
# compile's imports), BiSeNetV2 12-50, Segformer-B0 13-59, Swin-T 16-53:
# Dynamo and AOTAutograd trace each lean Function's forward and backward.
# The zoo families are marked as the zoo's other checks are (deselected
# with -m "not zoo").
_PARAMS = [pytest.param(m, marks=() if m == 'pspnet_r18' else
                        pytest.mark.zoo) for m in MODELS]


@pytest.mark.parametrize('name', _PARAMS)
def test_lean_loss_is_one_capturable_graph(name):
    """One graph (no more than the plain model's), no mutated non-static
    input in any graph, the eager loss and gradients."""
    build, size, batch = MODELS[name]
    plain, lean = build()
    assert lean_counts(lean), name
    inputs, samples = random_batch(plain, (size, size), batch,
                                   label_block=4)
    with kernels_off(), as_on_cuda():
        want, want_grads = _step(lean, lean.loss, inputs, samples)
        (got, got_grads), graphs, breaks = _compiled_step(lean, inputs,
                                                          samples)
        # where the lean loss is not one graph, the plain one's counts
        plain_graphs, plain_breaks = (graphs, breaks) if len(graphs) == 1 \
            and not breaks else _compiled_step(plain, inputs, samples)[1:]
    assert graphs and all(not g['mutated_non_static'] for g in graphs), \
        graphs
    assert len(graphs) <= max(1, len(plain_graphs)) and \
        breaks <= plain_breaks, (len(graphs), breaks, len(plain_graphs),
                                 plain_breaks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert set(got_grads) == set(want_grads) and want_grads
    for key, g in want_grads.items():
        torch.testing.assert_close(got_grads[key], g, rtol=1e-4,
                                   atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m: f'{name} {key}: {m}')
