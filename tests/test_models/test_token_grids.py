"""Token grids of mmseg's transformer models, found from the traced call, and
filtered Linears / attentions on them in whole models
(docs/gradient_filter.md#linear-layers-on-token-grids).

Each family is mmseg 1.2.2's zoo config made offline (SyncBN -> BN, random
weights) and shrunk (narrow embeddings, one or two blocks per stage, the
heads' channels), at 64x64, float64, eval mode (no dropout / DropPath):

* discovery lists every Linear and attention of the inference path, in
  execution order, with the grid of its call (Segformer's reduced keys,
  Swin's 7x7 windows and merged grids, Twins' locally grouped windows,
  ViT's and BEiT's / MAE's cls token, BEiT's ``qkv`` that mmseg computes
  with ``F.linear`` on its weight, DPT's readout projections on each input
  map's grid, Segmenter's trailing class embeddings and its grid-less
  class projection);
* with every gridded layer filtered at r = 1 the model's gradients equal
  the plain model's; at r = 2 they equal a reference model whose layers
  filter with autograd hooks and the float64 loops of
  tests/helpers/gf_linear_reference.py, and differ from the plain ones.
"""
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip('mmseg')

from mmseg_gf.models.gf_conv import GFExactBackwardWarning  # noqa: E402
from mmseg_gf.models.layer_kinds import layer_kind  # noqa: E402
from mmseg_gf.models.token_grids import (CLASS_SCORES,  # noqa: E402
                                         bind_token_grids,
                                         discover_token_grids,
                                         run_inference_path, token_kind_of)
from mmseg_gf.ops import TokenGrid  # noqa: E402
from tests.helpers.gf_linear_reference import (  # noqa: E402
    reference_attention, reference_filtered_linear)
from tests.helpers.token_families import (  # noqa: E402
    FAMILIES, SIZE, tiny_model)


def _inputs():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(2, 3, SIZE, SIZE, generator=gen, dtype=torch.float64)


pytestmark = pytest.mark.usefixtures('one_thread')


def _by_path(records):
    return {r.path: r for r in records}


def _expect_segformer(records):
    attn = [r for r in records if r.kind == 'attention']
    assert [r.path for r in records] == [
        f'backbone.layers.{i}.1.0.attn.attn' for i in range(4)]
    # stages at 1/4 .. 1/32 of 64; keys after sr convs of ratio 8, 4, 2, 1
    assert [(r.grid, r.key_grid) for r in attn] == [
        (TokenGrid(16, 16), TokenGrid(2, 2)),
        (TokenGrid(8, 8), TokenGrid(2, 2)),
        (TokenGrid(4, 4), TokenGrid(2, 2)),
        (TokenGrid(2, 2), TokenGrid(2, 2))]


def _expect_swin(records):
    rec = _by_path(records)
    window = TokenGrid.windows(7)
    assert rec['backbone.stages.0.blocks.0.attn.w_msa.qkv'].grid == window
    assert rec['backbone.stages.0.blocks.1.attn.w_msa.proj'].grid == window
    assert rec['backbone.stages.0.blocks.1.attn.w_msa.qkv'].input_shape == (
        2 * 9, 49, 12)  # 16x16 padded to 21x21: 9 windows per image
    assert rec['backbone.stages.0.blocks.0.ffn.layers.0.0'].grid == \
        TokenGrid(16, 16)
    assert rec['backbone.stages.3.blocks.0.ffn.layers.1'].grid == \
        TokenGrid(2, 2)
    merges = [r for r in records if r.path.endswith('downsample.reduction')]
    assert [r.grid for r in merges] == [
        TokenGrid(8, 8), TokenGrid(4, 4), TokenGrid(2, 2)]


def _expect_pcpvt(records):
    rec = _by_path(records)
    assert rec['backbone.layers.0.0.attn.attn'].key_grid == TokenGrid(2, 2)
    assert rec['backbone.layers.0.0.attn.attn'].grid == TokenGrid(16, 16)
    assert rec['backbone.layers.1.0.ffn.layers.0.0'].grid == TokenGrid(8, 8)


def _expect_svt(records):
    rec = _by_path(records)
    qkv = rec['backbone.layers.0.0.attn.qkv']  # locally grouped, 7x7
    assert qkv.grid == TokenGrid(7, 7, layout='hwc') and qkv.token_dim == 3
    assert qkv.input_shape == (2, 3, 3, 7, 7, 16)
    assert rec['backbone.layers.0.0.attn.proj'].grid == TokenGrid(16, 16)
    gsa = rec['backbone.layers.0.1.attn.attn']  # global sub-sampled
    assert (gsa.grid, gsa.key_grid) == (TokenGrid(16, 16), TokenGrid(2, 2))


def _expect_deit(records):
    grids = {r.grid for r in records}
    assert grids == {TokenGrid(4, 4, extra_tokens=1)}  # cls + 64/16 square
    assert len(records) == 4 * 3  # attention and two FFN Linears per layer


def _expect_segmenter(records):
    rec = _by_path(records)
    assert rec['backbone.layers.1.attn.attn'].grid == TokenGrid(4, 4, 1)
    assert rec['decode_head.dec_proj'].grid == TokenGrid(4, 4)
    assert rec['decode_head.layers.0.attn.attn'].grid == TokenGrid(
        4, 4, trailing_tokens=5)
    assert rec['decode_head.patch_proj'].grid == TokenGrid(4, 4)
    classes = rec['decode_head.classes_proj']
    assert classes.grid is None and 'class embeddings' in classes.no_grid
    assert classes.role == rec['decode_head.patch_proj'].role == CLASS_SCORES
    assert [r.path for r in records if r.grid is None] == [
        'decode_head.classes_proj']


def _expect_beit(records):
    """BEiT (``qkv`` through ``F.linear`` with its q / v biases: called as
    a module while bound) and MAE: four Linears per layer on the patch
    grid plus the cls token."""
    assert [r.path for r in records] == [
        f'backbone.layers.{i}.{name}' for i in range(4)
        for name in ('attn.qkv', 'attn.proj', 'ffn.layers.0.0',
                     'ffn.layers.1')]
    assert {r.grid for r in records} == {TokenGrid(4, 4, extra_tokens=1)}
    assert records[0].input_shape == (2, 1 + 16, 32)


def _expect_dpt(records):
    """The ViT's layers as DeiT's; each readout projection on the 4x4 map
    of its input, ``cat(tokens, cls)`` of 2 x 32 channels, no extra
    token."""
    readouts = [r for r in records if '.readout_projects.' in r.path]
    assert [r.path for r in readouts] == [
        f'decode_head.reassemble_blocks.readout_projects.{i}.0'
        for i in range(4)]
    assert all(r.grid == TokenGrid(4, 4) and r.input_shape == (2, 16, 64)
               for r in readouts)
    assert {r.grid for r in records if r not in readouts} == {
        TokenGrid(4, 4, extra_tokens=1)}
    assert len(records) == 4 * 3 + 4


EXPECTATIONS = {
    'segformer_b0': _expect_segformer,
    'swin_t': _expect_swin,
    'twins_pcpvt_s': _expect_pcpvt,
    'twins_svt_s': _expect_svt,
    'deit_s': _expect_deit,
    'segmenter_vit_t': _expect_segmenter,
    'beit_b': _expect_beit,
    'mae_b': _expect_beit,
    'dpt_vit_b': _expect_dpt,
}


@pytest.mark.parametrize('name', list(FAMILIES))
def test_discovery_lists_every_linear_with_its_traced_grid(name):
    model = tiny_model(name)
    records = discover_token_grids(model, _inputs())
    EXPECTATIONS[name](records)
    # every Linear / attention of the inference path, and nothing else
    on_path = {
        p for part in ('backbone', 'decode_head')
        for p, m in getattr(model, part).named_modules(prefix=part)
        if token_kind_of(m) is not None and '.attn.attn.out_proj' not in p
        and not p.endswith('.out_proj')
    }
    assert {r.path for r in records} == on_path
    for r in records:
        assert (r.grid is None) == (r.no_grid is not None), r
    # no hook nor forward of the bindings is left behind
    assert all(not m._forward_pre_hooks and not m._forward_hooks
               and 'forward' not in m.__dict__ for m in model.modules())


def filtered_module(module, site, radius):
    """The filtered module of a bound site: its layer kind's, sharing the
    Parameters (the kind reads the site the bindings published)."""
    return layer_kind(site.kind).from_plain(module, radius, True)


class _ReferenceLinear(nn.Module):
    """Wraps the layer as its child ``ref`` (``_gradients`` drops the
    ``.ref`` from parameter names)."""

    def __init__(self, linear, site, radius):
        super().__init__()
        self.ref, self.site, self.radius = linear, site, radius

    def forward(self, x):
        return reference_filtered_linear(x, self.ref.weight, self.ref.bias,
                                         self.site.source.grid,
                                         self.site.token_dim, self.radius)


class _ReferenceAttention(nn.Module):
    def __init__(self, attention, site, radius):
        super().__init__()
        self.ref, self.site, self.radius = attention, site, radius

    def forward(self, query, key, value, attn_mask=None,
                key_padding_mask=None, **kwargs):
        assert attn_mask is None and key_padding_mask is None
        return reference_attention(self.ref, query, key, value,
                                   self.site.source.grid,
                                   self.site.key_source.grid,
                                   self.radius), None


def _swapped(model, make):
    bindings = bind_token_grids(model)
    swapped = 0
    for path, site in bindings.sites.items():
        if site.no_grid is not None:
            continue
        parent, _, name = path.rpartition('.')
        owner = model.get_submodule(parent)
        setattr(owner, name, make(getattr(owner, name), site))
        swapped += 1
    assert swapped
    return bindings


def _gradients(model, inputs, grad):
    for p in model.parameters():
        p.grad = None
        p.requires_grad_(True)
    out = run_inference_path(model, inputs)
    out.backward(grad)
    return {n.replace('.ref.', '.'): p.grad.clone()
            for n, p in model.named_parameters() if p.grad is not None}


def swapped_gradients(model, inputs, grad, make):
    """The gradients of ``model`` with each gridded Linear swapped by
    ``make(module, site)``; a call without its grid fails the test."""
    bindings = _swapped(model, make)
    try:
        with warnings.catch_warnings():  # every call has its grid
            warnings.simplefilter('error', GFExactBackwardWarning)
            return _gradients(model, inputs, grad)
    finally:
        bindings.remove()


def plain_model_and_grad(name: str):
    """``(inputs, plain tiny model, a random gradient of its output)``:
    the fixed starting point of the gradient comparisons."""
    inputs = _inputs()
    plain = tiny_model(name)
    with torch.no_grad():
        out = run_inference_path(plain, inputs)
    grad = torch.randn(out.shape, dtype=out.dtype,
                       generator=torch.Generator().manual_seed(3))
    return inputs, plain, grad


@pytest.mark.parametrize('name', list(FAMILIES))
def test_filtered_models_match_plain_at_r1_and_reference_at_r2(name):
    inputs, plain, grad = plain_model_and_grad(name)
    want = _gradients(plain, inputs, grad)

    def gradients(radius, make):
        return swapped_gradients(tiny_model(name), inputs, grad,
                                 lambda module, site: make(module, site,
                                                           radius))

    def close(a, b, rtol):
        assert a.keys() == b.keys()
        for key in a:
            scale = float(b[key].abs().max()) or 1.0
            torch.testing.assert_close(a[key], b[key], rtol=rtol,
                                       atol=rtol * scale, msg=key)

    close(gradients(1, filtered_module), want, 1e-10)
    filtered = gradients(2, filtered_module)
    reference = gradients(2, lambda m, site, r: _ReferenceAttention(
        m, site, r) if site.kind == 'attention' else _ReferenceLinear(
            m, site, r))
    close(filtered, reference, 1e-9)
    # the filter acted: the first filtered layer's weight gradient moved
    differs = [k for k in want
               if not torch.allclose(filtered[k], want[k], rtol=1e-6)]
    assert differs


@pytest.mark.parametrize('name', ['segformer_b0', 'swin_t', 'deit_s',
                                  'dpt_vit_b'])
def test_grids_follow_each_call_non_square_and_resized(name):
    """One bound model called at two sizes, 96x64 then 64x64: each call's
    grids come from that call (a transposed or stale grid would differ
    from the reference, or be refused), and are cleared after it."""
    model = tiny_model(name)
    ref_model = tiny_model(name)
    bindings = _swapped(model, lambda m, site: filtered_module(m, site, 2))
    ref_bindings = _swapped(
        ref_model, lambda m, site, r=2: _ReferenceAttention(m, site, r)
        if site.kind == 'attention' else _ReferenceLinear(m, site, r))
    gen = torch.Generator().manual_seed(4)
    for size in ((96, 64), (SIZE, SIZE)):
        inputs = torch.randn(2, 3, *size, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            out = run_inference_path(model, inputs)
        grad = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        got = _gradients(model, inputs, grad)
        want = _gradients(ref_model, inputs, grad)
        for key in want:
            scale = float(want[key].abs().max()) or 1.0
            torch.testing.assert_close(got[key], want[key], rtol=1e-9,
                                       atol=1e-9 * scale, msg=key)
        # per-call grids are cleared after the call (windows are fixed)
        sources = [src for site in bindings.sites.values()
                   for src in (site.source, site.key_source)
                   if src is not None and 'window_size' not in src.name]
        assert sources and all(src.grid is None for src in sources)
    bindings.remove()
    ref_bindings.remove()


def test_auto_radius_of_a_swin_window_goes_by_the_stage_map():
    """``radius='auto'`` by the map a layer's output covers: a Linear on
    Swin's 7x7 windows of the 16x16 stage-0 map (padded to 21x21, nine
    windows) takes the stage's radius, as the FFN on the whole map does,
    not a 7x7 grid's (output stride 64 / 7 = 9, r = 2)."""
    from mmseg_gf.engine import select_layers
    choices = select_layers(tiny_model('swin_t'),
                            layers=['backbone.stages.0.blocks.0'],
                            radius='auto', input_size=(SIZE, SIZE))
    by_path = {c.path.rsplit('blocks.0.', 1)[1]: c for c in choices}
    window, ffn = by_path['attn.w_msa.qkv'], by_path['ffn.layers.0.0']
    assert window.geometry.grid == TokenGrid.windows(7)
    assert window.geometry.map_area == 9 * 49
    assert (window.output_stride, ffn.output_stride) == (3, 4)
    assert window.radius == ffn.radius == 8
