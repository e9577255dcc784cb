"""The bindings: hooks on a model's blocks that keep its token grids current.

Hooks sit on blocks, never on the layers a surgery replaces, so they
survive the swap; they hold their sources, so ``copy.deepcopy`` gives a
copy bound to its own; nothing is in ``state_dict``. Installed on the
segmentor, so DDP runs them too."""
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ...patching import Override, override
from ..gf_linear import TokenGridSource
from .recompute import CheckpointWithGrids
from .registry import checkpointed_blocks, grid_rules, known_blocks
from .sites import LinearSite, inside_token_layer, token_kind_of, under

__all__ = ['TokenGridBindings', 'bind_token_grids', 'install_token_grids',
           'uninstall_token_grids', 'site_of', 'BINDINGS_ATTR']


class _SetGrids:
    """A hook setting grid sources from a rule; an object, not a closure, so
    ``copy.deepcopy`` of a model copies its sources with it."""

    def __init__(self, rule: Callable, sources: Sequence[TokenGridSource]
                 ) -> None:
        self.rule = rule
        self.sources = tuple(sources)

    def __call__(self, module, args, *rest) -> None:
        for source, grid in zip(self.sources, self.rule(module, args,
                                                        *rest)):
            source.set(grid)


class _ClearGrids:
    """A forward hook clearing grid sources after the block's call."""

    def __init__(self, sources: Sequence[TokenGridSource]) -> None:
        self.sources = tuple(sources)

    def __call__(self, module, args, kwargs, output) -> None:
        for source in self.sources:
            source.clear()


class TokenGridBindings:
    """The hooks that keep a model's grid sources current, and its sites."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: Dict[str, LinearSite] = {}
        self._handles: List = []
        #: the undos of the blocks' replaced forwards, in install order
        self._forward_undos: List[Override] = []

    def remove(self) -> None:
        """Remove every hook (the sources then stay empty) and forget the
        modules' sites (:func:`site_of`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._forward_undos:
            self._forward_undos.pop()()
        for module, (owner, _) in list(_SITE_OF.items()):
            if owner is self:
                del _SITE_OF[module]

    def publish(self) -> None:
        """Make each bound module's site known to :func:`site_of` (the
        layer kinds' geometry and from_plain read it)."""
        for path, site in self.sites.items():
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                continue
            _SITE_OF[module] = (self, site)

    # -- used by the rules ---------------------------------------------------
    def set_around(self, block: nn.Module,
                   rule: Callable[[nn.Module, tuple, dict], tuple],
                   sources: Sequence[TokenGridSource]) -> None:
        """Before every call of ``block`` set ``sources`` to the grids
        ``rule(block, args, kwargs)`` gives; clear them after it."""
        self._handles.append(
            block.register_forward_pre_hook(_SetGrids(rule, sources),
                                            with_kwargs=True))
        self._handles.append(
            block.register_forward_hook(_ClearGrids(sources),
                                        with_kwargs=True, always_call=True))

    def set_after(self, module: nn.Module,
                  rule: Callable[[nn.Module, tuple, object], tuple],
                  sources: Sequence[TokenGridSource]) -> None:
        """After every call of ``module`` set ``sources`` to the grids
        ``rule(module, args, output)`` gives."""
        self._handles.append(
            module.register_forward_hook(_SetGrids(rule, sources)))

    def recompute_with_grids(self, block: nn.Module, prefix: str) -> None:
        """Give a rule's checkpointed ``block`` a forward that checkpoints it
        with each call's grids."""
        sources = []
        for path, site in self.sites.items():
            if not under(path, prefix):
                continue
            for source in (site.source, site.key_source):
                if source is not None and all(source is not s
                                              for s in sources):
                    sources.append(source)
        if sources:
            self.replace_forward(block, CheckpointWithGrids(block, sources))

    def replace_forward(self, block: nn.Module, forward: Callable) -> None:
        """Run ``forward`` in place of ``block``'s own until :meth:`remove`
        (hooks of the block still run around it)."""
        self._forward_undos.append(override(block, 'forward', forward))

    def bind(self, site: LinearSite) -> None:
        if site.path not in self.sites:  # the innermost rule wins
            self.sites[site.path] = site

    def bind_layer(self, path: str, source: Optional[TokenGridSource],
                   key_source: Optional[TokenGridSource] = None,
                   token_dim: int = 1, rule: Optional[str] = None,
                   **details) -> None:
        """Bind the layer on tokens at ``path`` to ``source``; ``details``: the
        other :class:`LinearSite` fields."""
        kind = token_kind_of(self.model.get_submodule(path))
        if kind is None:
            raise TypeError(f'{path} is no layer on tokens (a rule of '
                            f'{rule} binds it)')
        self.bind(LinearSite(path, kind.name, source, key_source, token_dim,
                             rule, **details))

    def bind_all(self, container: nn.Module, prefix: str,
                 source: TokenGridSource, rule: str) -> None:
        """Every Linear and attention under ``container`` reads ``source``
        (self-attention: keys on the same grid)."""
        for name, module in container.named_modules(prefix=prefix):
            kind = token_kind_of(module)
            if kind is not None and not inside_token_layer(container, prefix,
                                                           name):
                self.bind(LinearSite(name, kind.name, source, source, 1,
                                     rule))


#: module -> (bindings, site) of the bindings installed last on its model.
_SITE_OF: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()

#: Attribute of a segmentor holding its installed bindings
#: (:func:`install_token_grids`); a plain attribute, not in ``state_dict``.
BINDINGS_ATTR = '_gf_token_grids'


def site_of(module: nn.Module) -> Optional[LinearSite]:
    """The site of a Linear / attention of a bound model, or None."""
    entry = _SITE_OF.get(module)
    return None if entry is None else entry[1]


def install_token_grids(model: nn.Module) -> Optional[TokenGridBindings]:
    """Bind ``model``'s token grids for good, so its filtered Linears find
    their grids in every step.

    Returns:
        The new bindings, or None when installed already."""
    if model.__dict__.get(BINDINGS_ATTR) is not None:
        return None
    bindings = bind_token_grids(model)
    model.__dict__[BINDINGS_ATTR] = bindings
    return bindings


def uninstall_token_grids(model: nn.Module) -> None:
    """Remove what :func:`install_token_grids` installed, if anything."""
    bindings = model.__dict__.pop(BINDINGS_ATTR, None)
    if bindings is not None:
        bindings.remove()


def bind_token_grids(model: nn.Module) -> TokenGridBindings:
    """Hook ``model``'s blocks so that every covered Linear / attention has
    its grid at call time; describe every Linear / attention of the model.

    Returns:
        The bindings: ``sites`` by module path (a layer no rule covers has
        ``source=None`` and ``no_grid`` saying so); ``remove()`` takes the
        hooks off.
    """
    bindings = TokenGridBindings(model)
    modules = list(model.named_modules())
    for rule in grid_rules():
        for path, module in modules:
            if isinstance(module, rule.blocks):
                rule.bind(bindings, path, module)
    _bind_checkpointed(bindings, modules)
    for path, module in modules:
        kind = token_kind_of(module)
        if kind is None or path in bindings.sites or inside_token_layer(
                model, '', path):
            continue
        parent = model.get_submodule(path.rpartition('.')[0]) \
            if '.' in path else model
        bindings.sites[path] = LinearSite(
            path, kind.name, no_grid='no token-grid rule covers it (in a '
            f'{type(parent).__name__}); known blocks: ' + known_blocks())
    bindings.publish()
    return bindings


def _bind_checkpointed(bindings: TokenGridBindings, modules) -> None:
    """Recompute the rules' checkpointed blocks with their grids; other
    ``with_cp=True`` modules' Linears are on no grid."""
    checkpointed = checkpointed_blocks()
    for path, module in modules:
        if isinstance(module, checkpointed):
            bindings.recompute_with_grids(module, path)
        elif getattr(module, 'with_cp', False) is True and not any(
                isinstance(m, checkpointed) for m in module.modules()):
            why = (f'it is inside {path or "the model"} '
                   f'({type(module).__name__}), built with with_cp=True, '
                   'whose recompute in the backward would not set its '
                   'grid; build it with with_cp=False')
            for name, site in bindings.sites.items():
                if under(name, path) and site.no_grid is None:
                    bindings.sites[name] = LinearSite(
                        name, site.kind, token_dim=site.token_dim,
                        rule=site.rule, no_grid=why, role=site.role)
