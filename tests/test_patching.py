"""mmseg_gf.patching: each mechanism's undo gives the object back
exactly (its class, its instance ``__dict__``, its hooks)."""
import copy
import types

import pytest
import torch
from torch import nn

from mmseg_gf import patching
from mmseg_gf.patching import (Hooks, is_swapped, override, overridden,
                               plain_class, swap_class, swapped_class,
                               unswap_class)


class _Doubled:
    """A test mixin: the module's output doubled."""

    def forward(self, x):
        return 2 * super().forward(x)


class _Other:
    pass


def _state(module: nn.Module) -> tuple:
    """What an undo must give back: the class, the instance ``__dict__``
    (keys and values by identity) and the hook dictionaries."""
    return (type(module), {k: id(v) for k, v in vars(module).items()},
            dict(module._forward_hooks), dict(module._forward_pre_hooks))


def test_swap_class_puts_the_mixin_in_front_and_unswap_gives_it_back():
    relu = nn.ReLU()
    relu.extra = object()
    before = _state(relu)
    swap_class(relu, _Doubled, 'test', 'DoubledReLU')
    assert isinstance(relu, nn.ReLU) and isinstance(relu, _Doubled)
    assert type(relu).__name__ == 'DoubledReLU'
    assert type(relu).__module__ == nn.ReLU.__module__
    assert torch.equal(relu(torch.tensor([-1., 3.])), torch.tensor([0., 6.]))
    assert plain_class(relu) is nn.ReLU and is_swapped(relu, 'test')
    assert unswap_class(relu, 'test')
    assert _state(relu) == before
    assert not unswap_class(relu, 'test')  # nothing left to undo


def test_the_swapped_class_is_made_once_and_named_as_the_plain_one():
    a, b = nn.ReLU(), nn.ReLU()
    swap_class(a, _Doubled, 'test')
    swap_class(b, _Doubled, 'test')
    assert type(a) is type(b) is swapped_class(nn.ReLU, _Doubled, 'test')
    assert type(a).__name__ == 'ReLU'
    # the state dict's keys are the plain module's
    conv = nn.Conv2d(1, 1, 1)
    keys = list(conv.state_dict())
    swap_class(conv, _Other, 'test')
    assert list(conv.state_dict()) == keys


def test_each_owner_undoes_only_its_own_swaps():
    relu = nn.ReLU()
    swap_class(relu, _Doubled, 'one')
    assert is_swapped(relu) and is_swapped(relu, 'one')
    assert not is_swapped(relu, 'two')
    assert not unswap_class(relu, 'two') and type(relu) is not nn.ReLU
    with pytest.raises(ValueError, match='swapped already'):
        swap_class(relu, _Other, 'two')
    assert unswap_class(relu) and type(relu) is nn.ReLU


def test_plain_class_of_an_unswapped_module_is_its_class():
    assert plain_class(nn.GELU()) is nn.GELU
    assert not is_swapped(nn.GELU())


def test_override_undo_keeps_an_earlier_instance_forward():
    """The undo puts back what the instance held: an instance ``forward``
    set before the override survives it (a ``del`` would drop it)."""
    relu = nn.ReLU()
    earlier = lambda x: x + 1  # noqa: E731
    relu.forward = earlier
    before = _state(relu)
    undo = override(relu, 'forward', lambda x: x * 0)
    assert relu(torch.ones(1)).item() == 0
    undo()
    assert _state(relu) == before and relu.forward is earlier
    assert relu(torch.ones(1)).item() == 2


def test_override_undo_removes_what_it_added():
    relu = nn.ReLU()
    before = _state(relu)
    with overridden(relu, 'forward', lambda x: x * 0):
        assert 'forward' in vars(relu)
    assert _state(relu) == before and 'forward' not in vars(relu)


def test_overrides_undone_in_reverse_order_restore_the_first_state():
    relu = nn.ReLU()
    before = _state(relu)
    undo_a = override(relu, 'forward', lambda x: x)
    undo_b = override(relu, 'forward', lambda x: -x)
    undo_b()
    undo_a()
    assert _state(relu) == before


def test_override_of_a_module_function_puts_the_function_back():
    module = types.ModuleType('fake')
    module.f = original = lambda: 1
    with overridden(module, 'f', lambda: 2):
        assert module.f() == 2
    assert module.f is original


def test_a_copied_override_undoes_the_copy_only():
    """An undo kept with its owner (a model's lasting override) is copied
    with it: the copy's undo removes the copy's attribute, and the
    original keeps its own until its undo runs."""
    relu = nn.ReLU()
    before = _state(relu)
    relu.undo = override(relu, 'forward', lambda x: x * 0)
    twin = copy.deepcopy(relu)
    assert twin.undo.owner is twin
    twin.undo()
    assert 'forward' not in vars(twin) and twin(torch.ones(1)).item() == 1
    assert relu(torch.ones(1)).item() == 0
    relu.undo()
    del relu.undo
    assert _state(relu) == before


def test_override_is_undone_on_an_error():
    relu = nn.ReLU()
    with pytest.raises(RuntimeError):
        with overridden(relu, 'forward', lambda x: x):
            raise RuntimeError
    assert 'forward' not in vars(relu)


def test_hooks_are_removed_exactly():
    conv = nn.Conv2d(1, 1, 1)
    lasting = conv.register_forward_hook(lambda m, a, o: None)
    before = _state(conv)
    calls = []
    hooks = Hooks([conv.register_forward_hook(
        lambda m, a, o: calls.append(1))])
    hooks.add(conv.register_forward_pre_hook(lambda m, a: calls.append(0)))
    with hooks.removed_after():
        conv(torch.ones(1, 1, 2, 2))
    assert calls == [0, 1] and not hooks.handles
    assert _state(conv) == before
    lasting.remove()
    assert not conv._forward_hooks


def test_hooks_are_removed_on_an_error():
    conv = nn.Conv2d(1, 1, 1)
    hooks = Hooks()
    hooks.add(conv.register_forward_hook(lambda m, a, o: None))
    with pytest.raises(RuntimeError):
        with hooks.removed_after():
            raise RuntimeError
    assert not conv._forward_hooks


def test_private_attributes_share_one_prefix():
    assert patching.SWAP_MARKER.startswith(patching.PRIVATE_PREFIX)


def test_set_entry_and_its_undo_put_back_what_the_dict_held():
    table = dict(kept=1)
    undo_new = patching.set_entry(table, 'added', 2)
    undo_old = patching.set_entry(table, 'kept', 3)
    assert table == dict(kept=3, added=2)
    undo_old()
    undo_new()
    assert table == dict(kept=1)
