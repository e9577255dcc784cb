"""A backbone the plugin does not know gets its token grids from one grid
rule registered in this file alone (``register_grid_rule``): nothing else
in the package names it.

``TokenMixer`` blocks are called as ``forward(tokens, hw_shape)`` with
``(B, H*W, C)`` tokens, as mmseg's transformer blocks are. Without the
rule their Linears are on no grid (never selected); with it, discovery
lists them with the grid of their call, and the selection counts them,
filters them on that grid and trains them: at r = 1 the filtered Linears
are exact, at r = 2 their filter acts (float64, a tiny EncoderDecoder,
32x32, batch 2).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip('mmseg')

from mmengine.model import BaseModule  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

from mmseg_gf.accounting.batch import random_batch  # noqa: E402
from mmseg_gf.engine.config import (check_settings,  # noqa: E402
                                    select_and_apply)
from mmseg_gf.models.gf_conv import GFExactBackwardWarning  # noqa: E402
from mmseg_gf.models.gf_linear import GFLinear  # noqa: E402
from mmseg_gf.models.segmentor import set_frozen_norms_eval  # noqa: E402
from mmseg_gf.models.token_grids import (TokenGridSource,  # noqa: E402
                                         bind_token_grids,
                                         discover_token_grids,
                                         register_grid_rule,
                                         unregister_grid_rule)
from mmseg_gf.ops import TokenGrid  # noqa: E402
from tests.helpers.tiny_segmentors import fcn_head, tiny_segmentor  # noqa: E402

SIZE = (32, 32)
DIMS = 8

pytestmark = pytest.mark.usefixtures('one_thread')


class TokenMixer(BaseModule):
    """A pre-norm MLP block on tokens, called with their ``hw_shape``."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dims)
        self.fc1 = nn.Linear(dims, 2 * dims)
        self.fc2 = nn.Linear(2 * dims, dims)

    def forward(self, x, hw_shape):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


@MODELS.register_module(force=True)
class TokenMixerBackbone(BaseModule):
    """A 4x4 patch embedding, then two :class:`TokenMixer` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, DIMS, 4, stride=4)
        self.blocks = nn.ModuleList([TokenMixer(DIMS) for _ in range(2)])

    def forward(self, x):
        x = self.embed(x)
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            tokens = block(tokens, (h, w))
        return [tokens.transpose(1, 2).reshape(b, c, h, w)]


def _hw_grid(block, args, kwargs) -> tuple:
    return (TokenGrid(*args[1]), )


def token_mixer(bindings, path: str, block: nn.Module) -> None:
    """The grid rule: every Linear of a block on the ``hw_shape`` of its
    call."""
    tokens = TokenGridSource(name=path)
    bindings.set_around(block, _hw_grid, (tokens, ))
    bindings.bind_all(block, path, tokens, type(block).__name__)


@pytest.fixture
def mixer_rule():
    register_grid_rule(TokenMixer)(token_mixer)
    yield
    unregister_grid_rule(token_mixer)


def _model():
    return tiny_segmentor('TokenMixerBackbone', SIZE,
                          fcn_head(DIMS, 8)).double()


LINEARS = [f'backbone.blocks.{i}.fc{j}' for i in (0, 1) for j in (1, 2)]


def test_without_the_rule_the_linears_are_on_no_grid():
    sites = bind_token_grids(_model()).sites
    assert sorted(sites) == LINEARS
    assert all('no token-grid rule covers it (in a TokenMixer)'
               in site.no_grid for site in sites.values())


def test_discovery_gives_each_linear_the_grid_of_its_call(mixer_rule):
    inputs = torch.randn(2, 3, *SIZE, dtype=torch.float64)
    records = discover_token_grids(_model(), inputs)
    assert [r.path for r in records] == LINEARS
    assert all(r.grid == TokenGrid(8, 8) and r.rule == 'TokenMixer'
               for r in records)


def _filtered(radius):
    model = _model()
    settings = check_settings(dict(num_layers=6, radius=radius, lean=False))
    choices = select_and_apply(model, settings, SIZE)
    return model, [c for c in choices if c.kind == 'linear']


def _step_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    model.train()
    set_frozen_norms_eval(model)
    with warnings.catch_warnings():  # every call has its grid
        warnings.simplefilter('error', GFExactBackwardWarning)
        losses = model.loss(*batch)
        sum(v for k, v in losses.items() if 'loss' in k).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize('radius', [1, 2])
def test_selection_filters_and_trains_the_linears(mixer_rule, radius):
    model, linears = _filtered(radius)
    assert sorted(c.path for c in linears) == LINEARS
    assert all(isinstance(c.module, GFLinear)
               and c.geometry.grid == TokenGrid(8, 8) for c in linears)
    batch = random_batch(model, SIZE, 2, label_block=4)
    batch = (batch[0].double(), batch[1])
    got = _step_gradients(model, batch)
    for choice in linears:
        choice.module.enabled = False
    exact = _step_gradients(model, batch)
    weights = [f'{path}.weight' for path in LINEARS]
    same = [torch.allclose(got[w], exact[w], rtol=1e-10, atol=0)
            for w in weights]
    # at r = 2 the last fc2's output gradient comes patch-constant from
    # the filtered head conv: the filter acts on the Linears before it
    assert all(same) if radius == 1 else not any(same[:-1]), same
