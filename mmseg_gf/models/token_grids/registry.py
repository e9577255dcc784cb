"""The registry of grid rules: which mmseg block knows the grid of the
tokens its Linears see.

A grid rule ``rule(bindings, path, block)`` is called once per instance of
its block classes in a model; it hooks the block so that a
``TokenGridSource`` holds each call's grid, and describes the Linears /
attentions under it. A backbone family registers its rules in one file::

    @register_grid_rule(MyBlock, checkpointed=(MyBlock, ))
    def my_block(bindings, path, block):
        tokens = TokenGridSource(name=path)
        bindings.set_around(block, hw_grid, (tokens, ))
        bindings.bind_all(block, path, tokens, 'MyBlock')

Where blocks nest, a site keeps the first rule that binds it, so rules of
inner blocks register first. Not an mmengine ``Registry``: rules are looked
up by the class of a built model's module, never built from a config."""
from dataclasses import dataclass
from typing import Callable, List, Tuple

__all__ = ['GridRule', 'register_grid_rule', 'unregister_grid_rule',
           'grid_rules', 'checkpointed_blocks', 'known_blocks']


@dataclass(frozen=True)
class GridRule:
    """One registered rule.

    Attributes:
        blocks: the module classes it binds (subclasses too).
        bind: ``(bindings, path, block) -> None``.
        checkpointed: classes whose ``forward`` checkpoints its inner forward
            when ``with_cp`` is on; the bindings take that checkpoint
            themselves so the recompute reads its call's grids."""

    blocks: Tuple[type, ...]
    bind: Callable[..., None]
    checkpointed: Tuple[type, ...] = ()


_RULES: List[GridRule] = []


def register_grid_rule(*blocks: type, checkpointed: Tuple[type, ...] = ()
                       ) -> Callable[[Callable], Callable]:
    """Decorator registering ``bind`` as the grid rule of ``blocks`` (after
    earlier rules); returns ``bind`` unchanged.

    Raises:
        ValueError: no block class given, or one already has a rule."""
    if not blocks or not all(isinstance(b, type) for b in blocks):
        raise ValueError('register_grid_rule takes the block classes the '
                         f'rule binds, got {blocks!r}')

    def register(bind: Callable) -> Callable:
        for rule in _RULES:
            taken = [b.__name__ for b in blocks if b in rule.blocks]
            if taken:
                raise ValueError(f'{", ".join(taken)} already has the grid '
                                 f'rule {rule.bind.__qualname__}')
        _RULES.append(GridRule(tuple(blocks), bind, tuple(checkpointed)))
        return bind

    return register


def unregister_grid_rule(bind: Callable) -> None:
    """Remove every registration of ``bind`` (a rule registered for a
    while, e.g. by a test)."""
    _RULES[:] = [rule for rule in _RULES if rule.bind is not bind]


def grid_rules() -> Tuple[GridRule, ...]:
    """The registered rules, in registration order."""
    return tuple(_RULES)


def checkpointed_blocks() -> Tuple[type, ...]:
    """Every rule's :attr:`GridRule.checkpointed` classes."""
    return tuple(cls for rule in _RULES for cls in rule.checkpointed)


def known_blocks() -> str:
    """The block classes that have a rule, for messages."""
    return ', '.join(cls.__name__ for rule in _RULES for cls in rule.blocks)
