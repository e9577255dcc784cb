"""What a checkpoint's pickle refers to and declares, read without building
anything.

torch's error names only the first refused global and cannot name a nested
class; this module walks the opcodes of ``data.pkl`` (``pickletools``: it
runs nothing) with a symbolic stack, so a refusal names every name under
the spelling ``--trust-checkpoint-type`` accepts. The same walk adds up
what loading would build, for :mod:`.load_bounds`
(docs/reliability.md#what-a-file-may-cost).
"""
import functools
import pickletools
import zipfile
from dataclasses import dataclass, field
from typing import (Any, BinaryIO, Dict, List, Optional, Sequence, Set, Tuple,
                    Union)

import torch
from torch._utils import IMPORT_MAPPING, NAME_MAPPING

__all__ = ['checkpoint_pickle', 'names_in_pickle', 'scan_pickle',
           'PickleScan', 'data_pickle_info']

_GETATTR = ('builtins.getattr', '__builtin__.getattr')
_REBUILD_FROM_TYPE = 'torch._tensor._rebuild_from_type_v2'
#: torch's tensor rebuild functions -> the position of their size argument.
_TENSOR_SIZE_ARG = {
    'torch._utils._rebuild_tensor': 2,
    'torch._utils._rebuild_tensor_v2': 2,
    'torch._utils._rebuild_tensor_v3': 2,
    'torch._utils._rebuild_qtensor': 2,
    'torch._utils._rebuild_wrapper_subclass': 2,
    'torch._utils._rebuild_meta_tensor_no_storage': 1,
}
_SPARSE = 'torch._utils._rebuild_sparse_tensor'
#: Bytes a Python object / a container slot costs, for the estimate.
OBJECT_BYTES = 32
SLOT_BYTES = 8
#: No single declared count is believed past this (it only has to exceed
#: any cap).
_HUGE = 1 << 62


class _Name:
    __slots__ = ('path', )

    def __init__(self, path: str):
        self.path = path


class _Storage:
    """A storage the pickle loads (``BINPERSID``), with its element size."""
    __slots__ = ('itemsize', )

    def __init__(self, itemsize: int):
        self.itemsize = itemsize


class _List(list):
    """A list the pickle builds (its items tracked: a size may be one)."""


@dataclass
class PickleScan:
    """What a pickle names and declares.

    Attributes:
        names: every dotted name it uses, nested classes as
            ``module.Outer.Inner``, in order of first use.
        built_bytes: what loading it would build, as declared.
        storages: storage record key -> bytes the pickle declares for it.
        problem: why the declarations cannot be bounded, or None.
    """

    names: List[str]
    built_bytes: int = 0
    storages: Dict[str, int] = field(default_factory=dict)
    problem: Optional[str] = None


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out = min(out * max(v, 0), _HUGE)
    return out


def _int_size(value: Any) -> Optional[Tuple[int, ...]]:
    """A size given as numbers (a tuple or list of ints), else None."""
    if isinstance(value, (tuple, list)) and all(
            type(v) is int for v in value):
        return tuple(value)
    return None


def _itemsize(storage_type: Any) -> int:
    """Bytes per element of a pickled storage type; 16 (the largest) if
    unknown."""
    if isinstance(storage_type, _Name):
        return _storage_itemsize(storage_type.path)
    return 16


# keyed on names read from a file: bounded, whatever the file holds
@functools.lru_cache(maxsize=64)
def _storage_itemsize(path: str) -> int:
    module, _, name = path.rpartition('.')
    if module != 'torch':
        return 16
    if name == 'UntypedStorage':
        return 1
    try:
        dtype = torch.serialization.StorageType(name).dtype
    except (KeyError, AttributeError, TypeError):
        return 16
    return torch._utils._element_size(dtype)


def _allocating_units() -> Dict[str, int]:
    """Allow-listed constructors that allocate from a size -> bytes per
    unit."""
    units = {'builtins.bytearray': 1, 'torch.UntypedStorage': 1,
             'torch.storage.UntypedStorage': 1, 'torch.Tensor': 16,
             'torch.storage.TypedStorage': 16}
    for cls in torch._tensor_classes:
        units[f'{cls.__module__}.{cls.__name__}'] = 16
    return units


_ALLOCATING = _allocating_units()
#: Allow-listed callables that iterate over their argument: each element
#: of a sized argument costs its ``unit`` (a tensor's elements become 0-d
#: tensors, which ``Counter`` or ``set`` keep: 256 bytes each; a
#: bytearray's are small ints: 8).
_ITERATING = frozenset(['collections.Counter', 'collections.OrderedDict',
                        'builtins.set', 'builtins.bytearray', 'torch.Size',
                        'builtins.complex'])
#: Rebuild functions whose result is their first argument, wrapped.
_WRAPPING = frozenset(['torch._utils._rebuild_parameter',
                       'torch._utils._rebuild_parameter_with_state',
                       'torch.nn.parameter.Parameter'])
_TENSOR_ELEMENT = 256
_INT_ELEMENT = 8


class _Sized:
    """A value of ``count`` elements costing ``unit`` bytes each when
    iterated."""
    __slots__ = ('count', 'unit')

    def __init__(self, count: int, unit: int):
        self.count = count
        self.unit = unit


def _flat(value: Any, kind: type, depth: int = 0) -> List[Any]:
    """The items of type ``kind`` (exactly) in nested tuples / lists."""
    if type(value) is kind:
        return [value]
    if isinstance(value, (tuple, list)) and depth < 4:
        return [i for v in value for i in _flat(v, kind, depth + 1)]
    return []


def _allocated_count(path: str, args: tuple) -> int:
    """The units an allocating constructor makes."""
    if path == 'builtins.bytearray' and args:
        if isinstance(args[0], str):
            return len(args[0])
        if isinstance(args[0], _Sized):
            return args[0].count
    return _prod(_flat(args, int))


class _Walk:
    """The symbolic stack machine (see the module docstring)."""

    def __init__(self) -> None:
        self.stack: List[Any] = []
        self.marks: List[List[Any]] = []
        self.memo: Dict[Any, Any] = {}
        self.used: Dict[str, None] = {}  # ordered set
        self.parents: Set[str] = set()
        self.called: Set[str] = set()
        self.scan = PickleScan(names=[])

    def pop_mark(self) -> List[Any]:
        items = self.stack
        self.stack = self.marks.pop() if self.marks else []
        return items

    def push(self, value: Any, payload: int = 0) -> None:
        self.scan.built_bytes += OBJECT_BYTES + payload
        self.stack.append(value)

    def use(self, path: str) -> None:
        self.used.setdefault(path)

    def tensor_cost(self, path: str, args: Any) -> Optional[_Sized]:
        """The bytes of a tensor a rebuild function makes; the tensor."""
        if path == _SPARSE:  # (layout, (indices..., values, size, ...))
            data = args[1] if isinstance(args, tuple) and len(args) == 2 \
                else None
            sizes = [_int_size(x) for x in data[2:]] \
                if isinstance(data, tuple) else []
            size = next((x for x in sizes if x is not None), None)
            itemsize = 16
        else:
            index = _TENSOR_SIZE_ARG[path]
            size = _int_size(args[index]) if isinstance(args, tuple) and \
                len(args) > index else None
            first = args[0] if isinstance(args, tuple) and args else None
            itemsize = first.itemsize if isinstance(first, _Storage) else 16
        if size is None:
            self.scan.problem = (f'a tensor ({path}) whose size is not given '
                                 'as numbers')
            return None
        numel = _prod(size)
        self.scan.built_bytes += numel * itemsize
        return _Sized(numel, _TENSOR_ELEMENT)

    def call(self, func: Any, args: Any) -> Any:
        """Account for ``func(*args)``; the symbolic result."""
        if not isinstance(func, _Name):
            return None
        path = func.path
        self.called.add(path)
        args = args if isinstance(args, tuple) else ()
        if path == _REBUILD_FROM_TYPE and len(args) == 4:
            return self.call(args[0], args[2])
        if path in _ITERATING:
            self.scan.built_bytes += sum(
                min(x.count * x.unit, _HUGE) for x in _flat(args, _Sized))
        if path in _TENSOR_SIZE_ARG or path == _SPARSE:
            return self.tensor_cost(path, args)
        if path in _WRAPPING:
            return args[0] if args and isinstance(args[0], _Sized) else None
        if path in _ALLOCATING:
            count = _allocated_count(path, args)
            self.scan.built_bytes += count * _ALLOCATING[path]
            return _Sized(count, _INT_ELEMENT if _ALLOCATING[path] == 1
                          else _TENSOR_ELEMENT)
        if path == 'torch.Size' and len(args) == 1 and \
                _int_size(args[0]) is not None:
            return args[0]
        return None

    def reduce(self) -> None:
        args, func = self.stack.pop(), self.stack.pop()
        if isinstance(func, _Name) and func.path in _GETATTR and \
                isinstance(args, tuple) and len(args) == 2 and \
                isinstance(args[0], _Name) and isinstance(args[1], str):
            self.parents.add(args[0].path)
            path = f'{args[0].path}.{args[1]}'
            self.use(path)
            self.stack.append(_Name(path))
            return
        self.push(self.call(func, args))

    def persistent(self) -> None:
        pid = self.stack.pop()
        # ('storage', type, key, location, numel[, view metadata: legacy])
        if isinstance(pid, tuple) and len(pid) in (5, 6) and \
                pid[0] == 'storage' and isinstance(pid[2], str) and \
                type(pid[4]) is int:
            itemsize = _itemsize(pid[1])
            nbytes = min(max(pid[4], 0) * itemsize, _HUGE)
            key = pid[2]
            self.scan.storages[key] = max(self.scan.storages.get(key, 0),
                                          nbytes)
            self.stack.append(_Storage(itemsize))
        else:
            self.stack.append(None)

    # One handler per opcode torch's unpickler reads (``handlers``).
    def op_global(self, arg: str) -> None:
        path = _global_name(arg)
        self.use(path)
        self.stack.append(_Name(path))

    def op_newobj(self, arg: Any) -> None:
        args, cls = self.stack.pop(), self.stack.pop()
        self.push(self.call(cls, args))

    def op_mark(self, arg: Any) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def op_tuple(self, arg: Any) -> None:
        items = self.pop_mark()
        self.push(tuple(items), SLOT_BYTES * len(items))

    def op_tuple_n(self, n: int, arg: Any) -> None:
        stack = self.stack
        items = tuple(stack[-n:])
        del stack[-n:]
        self.push(items, SLOT_BYTES * n)

    def op_appends(self, arg: Any) -> None:
        items = self.pop_mark()
        self.scan.built_bytes += SLOT_BYTES * 2 * len(items)
        if isinstance(self.stack[-1], _List):
            self.stack[-1].extend(items)

    def op_setitems(self, arg: Any) -> None:
        self.scan.built_bytes += SLOT_BYTES * 2 * len(self.pop_mark())

    def op_append(self, arg: Any) -> None:
        stack = self.stack
        item = stack.pop()
        self.scan.built_bytes += SLOT_BYTES * 2
        if isinstance(stack[-1], _List):
            stack[-1].append(item)

    def op_setitem(self, arg: Any) -> None:
        del self.stack[-2:]
        self.scan.built_bytes += SLOT_BYTES * 2

    def op_put(self, arg: Any) -> None:
        self.memo[arg] = self.stack[-1]

    def op_get(self, arg: Any) -> None:
        self.stack.append(self.memo[arg])

    def op_text(self, arg: Any) -> None:
        self.push(arg, len(arg))

    def op_value(self, arg: Any) -> None:
        self.push(arg)

    def handlers(self) -> Dict[str, Any]:
        """Opcode name -> handler; an opcode not here ends the walk."""
        table = {
            'GLOBAL': self.op_global, 'REDUCE': lambda arg: self.reduce(),
            'NEWOBJ': self.op_newobj, 'MARK': self.op_mark,
            'TUPLE': self.op_tuple, 'APPENDS': self.op_appends,
            'SETITEMS': self.op_setitems, 'APPEND': self.op_append,
            'SETITEM': self.op_setitem,
            'BUILD': lambda arg: self.stack.pop(),
            'BINPERSID': lambda arg: self.persistent(),
            'EMPTY_LIST': lambda arg: self.push(_List()),
            'EMPTY_TUPLE': lambda arg: self.push(()),
            'PROTO': lambda arg: None, 'STOP': lambda arg: None,
        }
        for n in (1, 2, 3):
            table[f'TUPLE{n}'] = functools.partial(self.op_tuple_n, n)
        for names, handler in (
                (('BINPUT', 'LONG_BINPUT'), self.op_put),
                (('BINGET', 'LONG_BINGET'), self.op_get),
                (('BINUNICODE', 'SHORT_BINSTRING'), self.op_text),
                (('BININT', 'BININT1', 'BININT2', 'BINFLOAT', 'LONG1'),
                 self.op_value),
                (('NONE', 'NEWFALSE', 'NEWTRUE', 'EMPTY_DICT', 'EMPTY_SET'),
                 lambda arg: self.push(None))):
            table.update(dict.fromkeys(names, handler))
        return table


def scan_pickle(data: Union[bytes, BinaryIO]) -> PickleScan:
    """Names and declared costs of a pickle (see :class:`PickleScan`).

    Opcodes torch's ``weights_only`` unpickler refuses end the walk.
    """
    walk = _Walk()
    handlers = walk.handlers()
    try:
        for op, arg, _ in pickletools.genops(data):
            handler = handlers.get(op.name)
            if handler is None:
                break
            handler(arg)
    except (IndexError, KeyError, ValueError, TypeError):
        pass  # a malformed stream: torch refuses it when it gets there
    # A name used only as getattr's first argument is not needed itself.
    walk.scan.names = [p for p in walk.used
                       if p not in walk.parents or p in walk.called]
    return walk.scan


def names_in_pickle(data: bytes) -> List[str]:
    """Every dotted name the pickle uses, in order of first use."""
    return scan_pickle(data).names


def data_pickle_info(archive: zipfile.ZipFile) -> Optional[zipfile.ZipInfo]:
    """The record of a torch zip checkpoint's ``*/data.pkl``, or None."""
    pickles = [i for i in archive.infolist()
               if i.filename.endswith('/data.pkl') or
               i.filename == 'data.pkl']
    return pickles[0] if len(pickles) == 1 else None


def checkpoint_pickle(filename: str) -> Optional[bytes]:
    """The unbounded pickle of a zip checkpoint, or None; the loader uses
    :mod:`.load_bounds`."""
    if not zipfile.is_zipfile(filename):
        return None
    with zipfile.ZipFile(filename) as archive:
        info = data_pickle_info(archive)
        return None if info is None else archive.read(info)


def _global_name(arg: str) -> str:
    """``GLOBAL``'s ``'module name'`` as torch's unpickler maps it."""
    module, _, name = arg.partition(' ')
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f'{module}.{name}'
