"""mmcv's ``ConvModule`` as a lean kind (``mmseg_gf.models.conv_block``):
its fused node's cases run in a subprocess
(``tests/helpers/triton_block_cases.py``: interpreted here, compiled on
CUDA); here, what the swap does on CPU."""
import pytest
import torch

pytest.importorskip('mmcv')

from mmcv.cnn import ConvModule  # noqa: E402

from mmseg_gf.engine.lean_region import (apply_lean_region,  # noqa: E402
                                         remove_lean_region)
from mmseg_gf.models import GFConv2d  # noqa: E402
from mmseg_gf.models.lean import is_lean, lean_kind  # noqa: E402
from mmseg_gf.ops.conv_block import gpu as triton_conv_block  # noqa: E402
from tests.helpers.triton_runs import (CASE_RUNS, TRITON,  # noqa: E402
                                       run_case_file)


@TRITON
@pytest.mark.parametrize('interpret', CASE_RUNS)
def test_block_cases(interpret):
    run_case_file('triton_block_cases.py', interpret)


class _OwnForward(ConvModule):
    def forward(self, x, activate=True, norm=True):
        return super().forward(x, activate, norm) * 2


def test_conv_module_is_a_lean_kind_and_swaps_back():
    """A ConvModule becomes lean (same class name, state_dict keys and
    outputs) and back; a subclass with its own forward does not; on CPU
    tensors the block runs its modules (the fused node is the Triton
    path's)."""
    torch.manual_seed(0)
    block = ConvModule(3, 4, 3, padding=1, norm_cfg=dict(type='BN'))
    block.conv = GFConv2d.from_conv(block.conv, radius=2)
    block.eval()
    keys = list(block.state_dict())
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    want = block(x)
    apply_lean_region(block)
    assert is_lean(block) and lean_kind(block) == 'conv_block'
    assert type(block).__name__ == 'LeanConvModule'
    assert list(block.state_dict()) == keys
    calls = triton_conv_block.block_calls()
    torch.testing.assert_close(block(x), want, rtol=0, atol=0)
    assert triton_conv_block.block_calls() == calls
    remove_lean_region(block)
    assert type(block) is ConvModule
    own = _OwnForward(3, 4, 3, padding=1)
    assert lean_kind(own) is None


def test_resnet_blocks_are_lean_kinds():
    """mmseg's ResNet blocks become lean conv blocks (and back); on CPU
    tensors they run mmseg's forward, the same numbers."""
    from mmseg.models.backbones.resnet import BasicBlock, Bottleneck
    torch.manual_seed(0)
    for cls in (BasicBlock, Bottleneck):
        block = cls(8, 8 // cls.expansion).eval()
        x = torch.randn(1, 8, 6, 6, requires_grad=True)
        want = block(x)
        apply_lean_region(block)
        assert lean_kind(block) == 'conv_block'
        assert type(block).__name__ == f'Lean{cls.__name__}'
        torch.testing.assert_close(block(x), want, rtol=0, atol=0)
        remove_lean_region(block)
        assert type(block) is cls


def test_fused_geometry_is_decided_once_per_call_signature(monkeypatch):
    """The fused node's geometry is kept per call signature on the conv and
    decided again when the radius, the filter switch, a parameter's
    ``requires_grad``, the input's shape or a backend switch changes."""
    from mmseg_gf.models import call_plans, conv_block
    from mmseg_gf.ops.backend import dispatch, switches
    asked = []

    class _Triton:
        name = 'triton'

    def choose(name, *call):
        asked.append(name)
        return dispatch.Choice(_Triton(), (), ())

    monkeypatch.setattr(conv_block.dispatch, 'choose', choose)
    torch.manual_seed(0)
    conv = GFConv2d.from_conv(torch.nn.Conv2d(4, 4, 3, padding=1), radius=2)
    x = torch.randn(1, 4, 8, 8, requires_grad=True)

    def geometry():
        return conv_block.fused_geometry(conv, x)

    first = geometry()
    assert first == conv.collapsed_call(x)[2:] and first[4] == 2
    assert geometry() is first and len(asked) == 1
    conv.radius = 4
    assert geometry()[4] == 4 and len(asked) == 2
    conv.enabled = False
    assert geometry() is None  # not filtering: the three modules run
    conv.enabled = True
    conv.weight.requires_grad_(False)
    geometry()
    conv.weight.requires_grad_(True)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    geometry()
    with switches.override(MMSEG_GF_CONV_BLOCKS=False):
        geometry()
    assert len(asked) == 6
    assert len(call_plans.kept_plans(conv, 'block_geometry')) <= \
        call_plans.CACHE_SIZE
