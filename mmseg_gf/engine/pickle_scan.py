"""The names a checkpoint's pickle refers to, read without building
anything.

A refusal should name everything a file needs at once, each under the name
``--trust-checkpoint-type`` accepts. torch's own error names the first
refused global only, strips ``builtins.`` from builtin names, and cannot
name a nested class: torch saves with pickle protocol 2, which writes
``module.Outer.Inner`` as ``getattr(module.Outer, 'Inner')``. This module
walks the opcodes of the file's ``data.pkl`` (``pickletools.genops``: it
decodes, it runs nothing) with a symbolic stack that only tracks where
names go: every ``GLOBAL`` is a name, a ``getattr(name, 'attr')`` call is
the name ``name.attr``, and a name used only as such a parent is not
counted.
"""
import pickletools
import zipfile
from typing import Any, List, Optional, Set

from torch._utils import IMPORT_MAPPING, NAME_MAPPING

__all__ = ['checkpoint_pickle', 'names_in_pickle']

_GETATTR = ('builtins.getattr', '__builtin__.getattr')


class _Name:
    __slots__ = ('path', )

    def __init__(self, path: str):
        self.path = path


class _Mark:
    pass


def checkpoint_pickle(filename: str) -> Optional[bytes]:
    """The pickle of a checkpoint in torch's zip format (its
    ``*/data.pkl``), or None for another format."""
    if not zipfile.is_zipfile(filename):
        return None
    with zipfile.ZipFile(filename) as archive:
        pickles = [n for n in archive.namelist()
                   if n.endswith('/data.pkl') or n == 'data.pkl']
        if len(pickles) != 1:
            return None
        return archive.read(pickles[0])


def _global_name(arg: str) -> str:
    """``GLOBAL``'s ``'module name'`` as torch's unpickler maps it."""
    module, _, name = arg.partition(' ')
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f'{module}.{name}'


def names_in_pickle(data: bytes) -> List[str]:
    """Every dotted name the pickle uses, nested classes as
    ``module.Outer.Inner``, in order of first use.

    Opcodes outside what torch's ``weights_only`` unpickler accepts end the
    walk (torch refuses the file at that opcode anyway).
    """
    stack: List[Any] = []
    marks: List[List[Any]] = []
    memo: dict = {}
    used: List[str] = []
    parents: Set[str] = set()
    called: Set[str] = set()

    def use(path: str) -> None:
        if path not in used:
            used.append(path)

    def pop_mark() -> List[Any]:
        nonlocal stack
        items, stack = stack, marks.pop() if marks else []
        return items

    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == 'GLOBAL':
                path = _global_name(arg)
                use(path)
                stack.append(_Name(path))
            elif name == 'REDUCE':
                args, func = stack.pop(), stack.pop()
                if isinstance(func, _Name) and func.path in _GETATTR and \
                        isinstance(args, tuple) and len(args) == 2 and \
                        isinstance(args[0], _Name) and \
                        isinstance(args[1], str):
                    parents.add(args[0].path)
                    path = f'{args[0].path}.{args[1]}'
                    use(path)
                    stack.append(_Name(path))
                    continue
                if isinstance(func, _Name):
                    called.add(func.path)
                stack.append(None)
            elif name == 'NEWOBJ':
                stack.pop()
                cls = stack.pop()
                if isinstance(cls, _Name):
                    called.add(cls.path)
                stack.append(None)
            elif name == 'MARK':
                marks.append(stack)
                stack = []
            elif name == 'TUPLE':
                items = tuple(pop_mark())
                stack.append(items)
            elif name in ('TUPLE1', 'TUPLE2', 'TUPLE3'):
                n = int(name[-1])
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name in ('APPENDS', 'SETITEMS'):
                pop_mark()
            elif name in ('APPEND', 'BUILD', 'BINPERSID'):
                stack.pop()
                if name == 'BINPERSID':
                    stack.append(None)
            elif name == 'SETITEM':
                del stack[-2:]
            elif name in ('BINPUT', 'LONG_BINPUT'):
                memo[arg] = stack[-1]
            elif name in ('BINGET', 'LONG_BINGET'):
                stack.append(memo[arg])
            elif name in ('BINUNICODE', 'SHORT_BINSTRING', 'BININT',
                          'BININT1', 'BININT2', 'BINFLOAT', 'LONG1'):
                stack.append(arg)
            elif name in ('NONE', 'NEWFALSE', 'NEWTRUE', 'EMPTY_TUPLE',
                          'EMPTY_LIST', 'EMPTY_DICT', 'EMPTY_SET'):
                stack.append(None)
            elif name in ('PROTO', 'STOP'):
                continue
            else:
                break
    except (IndexError, KeyError, ValueError):
        pass  # a malformed stream: torch refuses it when it gets there
    # A name used only as getattr's first argument is not needed itself.
    return [p for p in used if p not in parents or p in called]
