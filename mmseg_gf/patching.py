"""The one place that changes other libraries' objects in place: class
swaps, instance overrides of a method, forward hooks, and dict entries.

mmseg builds the segmentors, heads and layers from a user's config before
this package sees them, and checkpoints, ``isinstance`` checks and
``state_dict`` keys must stay mmseg's; so each mechanism changes an
existing object and keeps what undoes it exactly (docs/patching.md lists
every use, what it touches and how it is undone):

* :func:`swap_class` gives a module a subclass of its own class with a
  mixin in front; :func:`unswap_class` gives the class back,
  :func:`plain_class` is the class a module had before;
* :func:`override` shadows a method (or a module-level function) with an
  attribute of the owner; its undo puts back what the owner's own
  ``__dict__`` held;
* :class:`Hooks` holds hook handles (:meth:`Hooks.removed_after` removes
  them when a block ends, also on an error);
* :func:`set_entry` sets one key of another library's dict; its undo puts
  back what the dict held under the key, or removes it.

Torch only, no mmseg: the lowest layer its users (ops included) allow."""
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
    """The subclass ``(mixin, cls)`` that :func:`swap_class` installs, made
    once per ``(cls, mixin, owner, name)``; named ``name`` (default:
    ``cls``'s name), in ``cls``'s module (reprs and logs read as mmseg's)."""
    name = cls.__name__ if name is None else name
    key = (cls, mixin, owner, name)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(name, (mixin, cls), {
            SWAP_MARKER: SwappedFrom(cls, owner),
            '__module__': cls.__module__})
    return _SWAPPED[key]


def swap_class(module, mixin: type, owner: str,
               name: Optional[str] = None) -> None:
    """Put ``mixin`` in front of ``module``'s class (its ``__dict__``,
    parameters, buffers and hooks are untouched); see
    :func:`swapped_class` for ``name``.

    Raises:
        ValueError: ``module`` is swapped already (swaps do not nest: the
            undo gives back the plain class).
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
    """Give ``module`` back the class it had before :func:`swap_class`
    (only a swap by ``owner``, if given); returns whether it did."""
    if not is_swapped(module, owner):
        return False
    module.__class__ = type(module).__dict__[SWAP_MARKER].plain
    return True


def plain_class(module) -> type:
    """The class ``module`` had before :func:`swap_class` (its own class if
    it is not swapped): what kind tests and reports name."""
    record = getattr(type(module), SWAP_MARKER, None)
    return type(module) if record is None else record.plain


class Override:
    """The undo of one :func:`override`: calling it puts back what
    ``vars(owner)`` held under ``name`` (``had_previous``: ``previous``),
    or removes the attribute.

    An object, not a closure, so that an override kept for good on a model
    (the token grids' recompute of a checkpointed block) is copied with the
    model: ``copy.deepcopy`` gives an undo of the copy's attribute, which
    leaves the original's alone.
    """

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
    """Set ``owner.<name>`` (an instance attribute shadowing a method, or a
    Python module's function) to ``value``; returns its undo.

    mmseg calls heads' ``forward`` and ``loss_by_feat`` directly
    (``self.forward(...)``), which module hooks do not see; an attribute of
    the instance does. The undo puts back what ``vars(owner)`` held before
    (an earlier override included) or removes the attribute; undo in the
    reverse order of the overrides.
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
    """The undo of one :func:`set_entry`: calling it puts back what
    ``mapping`` held under ``key`` (``had_previous``: ``previous``), or
    removes the key."""

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
    """Set ``mapping[key] = value`` in another library's dict (a table it
    looks names up in); returns its undo. Undo in the reverse order."""
    had_previous = key in mapping
    undo = Entry(mapping, key, mapping.get(key), had_previous)
    mapping[key] = value
    return undo


class Hooks:
    """Hook handles removed together (torch's ``RemovableHandle``s, or any
    object with ``remove()``)."""

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
