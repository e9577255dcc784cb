"""The step tracer's overrides of a decode head's methods are undone
exactly: the head's instance ``__dict__`` and hooks are as before."""
import torch
from torch import nn

from mmseg_gf.accounting.trace import StepTracer


class _Head(nn.Module):
    """What the tracer wraps: a module with ``loss_by_feat``, called
    directly (as mmseg's ``loss`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        return self.conv(x)

    def loss_by_feat(self, logits):
        return logits.sum()


def _state(module: nn.Module) -> tuple:
    return (type(module), {k: id(v) for k, v in vars(module).items()},
            dict(module._forward_hooks), dict(module._forward_pre_hooks))


def test_hooked_gives_the_heads_back_as_they_were():
    head, other = _Head(), _Head()
    earlier = other.forward  # an instance forward: not wrapped, kept
    other.forward = earlier
    model = nn.ModuleDict(dict(head=head, other=other))
    before = {m: _state(m) for m in model.modules()}
    calls = []
    tracer = StepTracer(model, calls.append, on_pack=lambda pack: None)
    with tracer.hooked():
        assert 'forward' in vars(head) and 'loss_by_feat' in vars(head)
        assert vars(other)['forward'] is earlier
        head.loss_by_feat(head.forward(torch.ones(1, 1, 2, 2)))
    assert calls
    assert {m: _state(m) for m in model.modules()} == before
    assert other.forward is earlier
