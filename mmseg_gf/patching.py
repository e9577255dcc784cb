"""The one place that changes other libraries' objects in place.

Class swaps, method overrides, hooks and dict entries, each keeping its
exact undo, so that checkpoints, ``isinstance`` checks and ``state_dict``
keys stay mmseg's (docs/patching.md lists every use). Torch only.
"""
import contextlib
from typing import (Dict, Iterable, Iterator, List, NamedTuple, Optional,
                    Tuple)

__all__ = ['PRIVATE_PREFIX', 'SWAP_MARKER', 'SwappedFrom', 'swapped_class',
           'swap_class', 'unswap_class', 'plain_class', 'is_swapped',
           'override', 'overridden', 'Override', 'Hooks', 'set_entry',
           'Entry']

#: Every attribute this package sets on another library's object starts
#: with it, so that none can clash with mmseg's or torch's own.
PRIVATE_PREFIX = '_gf_'
#: The one marker in a swapped class's ``__dict__``.
SWAP_MARKER = PRIVATE_PREFIX + 'swapped_from'


class SwappedFrom(NamedTuple):
    """What :func:`swap_class` records in the class it made."""
    #: the class the module had before the swap
    plain: type
    #: who swapped it (``'lean'``, ``'frozen_aux_heads'``): each owner
    #: undoes its own swaps only
    owner: str


_SWAPPED: Dict[Tuple[type, type, str, str], type] = {}


def swapped_class(cls: type, mixin: type, owner: str,
                  name: Optional[str] = None) -> type:
    """The subclass ``(mixin, cls)`` :func:`swap_class` installs, made once,
    named as ``cls``."""
    name = cls.__name__ if name is None else name
    key = (cls, mixin, owner, name)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(name, (mixin, cls), {
            SWAP_MARKER: SwappedFrom(cls, owner),
            '__module__': cls.__module__})
    return _SWAPPED[key]


def swap_class(module, mixin: type, owner: str,
               name: Optional[str] = None) -> None:
    """Put ``mixin`` in front of ``module``'s class.

    Raises:
        ValueError: ``module`` is swapped already (swaps do not nest).
    """
    if is_swapped(module):
        raise ValueError(f'{type(module).__name__} is swapped already')
    module.__class__ = swapped_class(type(module), mixin, owner, name)


def is_swapped(module, owner: Optional[str] = None) -> bool:
    """Whether :func:`swap_class` swapped ``module`` (by ``owner``, if
    given)."""
    record = type(module).__dict__.get(SWAP_MARKER)
    return record is not None and owner in (None, record.owner)


def unswap_class(module, owner: Optional[str] = None) -> bool:
    """Give ``module`` back its class from before :func:`swap_class`; returns
    whether it did."""
    if not is_swapped(module, owner):
        return False
    module.__class__ = type(module).__dict__[SWAP_MARKER].plain
    return True


def plain_class(module) -> type:
    """The class ``module`` had before :func:`swap_class`."""
    record = getattr(type(module), SWAP_MARKER, None)
    return type(module) if record is None else record.plain


class Override:
    """The undo of one :func:`override`; an object, so it is deep-copied with a
    model."""

    def __init__(self, owner, name: str, previous,
                 had_previous: bool) -> None:
        self.owner = owner
        self.name = name
        self.previous = previous
        self.had_previous = had_previous

    def __call__(self) -> None:
        if self.had_previous:
            setattr(self.owner, self.name, self.previous)
        else:
            delattr(self.owner, self.name)


def override(owner, name: str, value) -> Override:
    """Set ``owner.<name>`` to ``value``, shadowing a method; returns its undo.

    An instance attribute sees the direct calls (``self.forward(...)``) that
    module hooks miss. Undo in the reverse order of the overrides.
    """
    had_previous = name in vars(owner)
    undo = Override(owner, name, vars(owner).get(name), had_previous)
    setattr(owner, name, value)
    return undo


@contextlib.contextmanager
def overridden(owner, name: str, value) -> Iterator[None]:
    """:func:`override` for the block."""
    undo = override(owner, name, value)
    try:
        yield
    finally:
        undo()


class Entry:
    """The undo of one :func:`set_entry`."""

    def __init__(self, mapping, key, previous, had_previous: bool) -> None:
        self.mapping = mapping
        self.key = key
        self.previous = previous
        self.had_previous = had_previous

    def __call__(self) -> None:
        if self.had_previous:
            self.mapping[self.key] = self.previous
        else:
            self.mapping.pop(self.key, None)


def set_entry(mapping, key, value) -> Entry:
    """Set ``mapping[key] = value`` in another library's dict; returns its
    undo."""
    had_previous = key in mapping
    undo = Entry(mapping, key, mapping.get(key), had_previous)
    mapping[key] = value
    return undo


class Hooks:
    """Hook handles removed together."""

    def __init__(self, handles: Iterable = ()) -> None:
        self.handles: List = list(handles)

    def add(self, handle):
        """Keep ``handle``; returns it."""
        self.handles.append(handle)
        return handle

    def extend(self, handles: Iterable) -> None:
        self.handles.extend(handles)

    def remove(self) -> None:
        """Remove every hook (last added first) and forget them."""
        while self.handles:
            self.handles.pop().remove()

    @contextlib.contextmanager
    def removed_after(self) -> Iterator['Hooks']:
        """The hooks last for the block (removed also on an error)."""
        try:
            yield self
        finally:
            self.remove()
