"""Crafted checkpoints for the loader's tests, and a child process that
loads them (``mmseg_gf/engine/checkpoint/safe_load.py``).

A crafted pickle is written opcode by opcode (protocol 2, the opcodes
torch's ``weights_only`` unpickler reads) into torch's zip layout, so any
name with any arguments can be put in front of the loader, whether or not
it exists in this process. :func:`load_in_child` loads a batch of files in
a fresh Python process (a crash must not take the test runner with it) and
reports, per file, how the load ended.
"""
import json
import os
import os.path as osp
import struct
import subprocess
import sys
import zipfile
import zlib
from typing import Dict, List, Optional, Sequence

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))

# ------------------------------------------------------------ pickle bytes
PROTO = b'\x80\x02'
STOP = b'.'
MARK = b'('
TUPLE = b't'
REDUCE = b'R'
BUILD = b'b'
NEWOBJ = b'\x81'
NONE = b'N'
TRUE = b'\x88'
FALSE = b'\x89'
EMPTY_DICT = b'}'
EMPTY_LIST = b']'
SETITEMS = b'u'
APPENDS = b'e'


def glob(path: str) -> bytes:
    """``GLOBAL`` of a dotted name (the last dot splits module / name)."""
    module, _, name = path.rpartition('.')
    return b'c' + f'{module}\n{name}\n'.encode()


def text(value: str) -> bytes:
    data = value.encode('utf-8', 'surrogatepass')
    return b'X' + struct.pack('<I', len(data)) + data


def integer(value: int) -> bytes:
    if 0 <= value < 256:
        return b'K' + bytes([value])
    if -2**31 <= value < 2**31:
        return b'J' + struct.pack('<i', value)
    data = value.to_bytes((value.bit_length() + 8) // 8, 'little',
                          signed=True)
    return b'\x8a' + bytes([len(data)]) + data


def raw(data: bytes) -> bytes:
    """A bytes object, as protocol 2 writes one:
    ``_codecs.encode(latin1 text, 'latin1')``."""
    return call('_codecs.encode', text(data.decode('latin1')),
                text('latin1'))


def tup(*items: bytes) -> bytes:
    return MARK + b''.join(items) + TUPLE


def call(func, *args: bytes) -> bytes:
    """REDUCE: ``func(*args)``; ``func`` a dotted name or pickle bytes."""
    head = glob(func) if isinstance(func, str) else func
    return head + tup(*args) + REDUCE


def build(obj: bytes, state: bytes) -> bytes:
    return obj + state + BUILD


def newobj(cls: str, *args: bytes) -> bytes:
    return glob(cls) + tup(*args) + NEWOBJ


def dict_(pairs: Dict[str, bytes]) -> bytes:
    body = b''.join(text(k) + v for k, v in pairs.items())
    return EMPTY_DICT + MARK + body + SETITEMS


def list_(*items: bytes) -> bytes:
    return EMPTY_LIST + MARK + b''.join(items) + APPENDS


def pickle_of(body: bytes) -> bytes:
    return PROTO + body + STOP


BINPERSID = b'Q'


def storage(key: str, numel: int,
            storage_type: str = 'torch.FloatStorage') -> bytes:
    """A storage read from the record ``data/<key>`` (``BINPERSID``), as
    torch.save writes one."""
    return tup(text('storage'), glob(storage_type), text(key), text('cpu'),
               integer(numel)) + BINPERSID


def tensor(storage_pickle: bytes, size: Sequence[int],
           stride: Sequence[int], offset: int = 0) -> bytes:
    """``torch._utils._rebuild_tensor_v2`` of a storage, as torch.save
    writes a tensor."""
    return call('torch._utils._rebuild_tensor_v2', storage_pickle,
                integer(offset), tup(*map(integer, size)),
                tup(*map(integer, stride)), FALSE,
                call('collections.OrderedDict'))


# ---------------------------------------------------- numpy's own pickles
NUMPY_DTYPE = 'numpy.dtype'
RECONSTRUCT = 'numpy._core.multiarray._reconstruct'
SCALAR = 'numpy._core.multiarray.scalar'
HISTORY_BUFFER = 'mmengine.logging.history_buffer.HistoryBuffer'
REBUILD_FROM_TYPE = 'torch._tensor._rebuild_from_type_v2'


def dtype_state(order: str = '<', names: bytes = NONE,
                fields: bytes = NONE, elsize: int = -1,
                alignment: int = -1, flags: int = 0) -> bytes:
    return tup(integer(3), text(order), NONE, names, fields,
               integer(elsize), integer(alignment), integer(flags))


def dtype(spec: str, state: Optional[bytes] = None) -> bytes:
    """numpy's pickle of ``np.dtype(spec)`` with the given state."""
    made = call(NUMPY_DTYPE, text(spec), FALSE, TRUE)
    return build(made, state if state is not None else dtype_state())


def array(shape: Sequence[int], dtype_bytes: bytes, data: bytes) -> bytes:
    """numpy's pickle of an array: ``_reconstruct`` then its state."""
    made = call(RECONSTRUCT, glob('numpy.ndarray'), tup(integer(0)),
                raw(b'b'))
    return build(made, tup(integer(1), tup(*map(integer, shape)),
                           dtype_bytes, FALSE, raw(data)))


def history_buffer(state: bytes) -> bytes:
    return build(newobj(HISTORY_BUFFER), state)


def history_attribute(name: str) -> bytes:
    """``getattr(HistoryBuffer, name)``, as HistoryBuffer pickles its
    statistics methods."""
    return call('builtins.getattr', glob(HISTORY_BUFFER), text(name))


# ------------------------------------------------------------------ files
def write_checkpoint(path: str, data_pkl: bytes,
                     template: Optional[str] = None) -> str:
    """A file in torch's zip layout holding ``data_pkl``; the other
    records (tensor storages) copied from ``template`` if given."""
    records: Dict[str, bytes] = {}
    prefix = 'archive/'
    if template is not None:
        with zipfile.ZipFile(template) as source:
            names = source.namelist()
            prefix = names[0].split('/')[0] + '/'
            records = {n: source.read(n) for n in names}
    records[prefix + 'data.pkl'] = data_pkl
    records.setdefault(prefix + 'version', b'3\n')
    records.setdefault(prefix + 'byteorder', b'little')
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_STORED) as out:
        for name, data in records.items():
            out.writestr(name, data)
    return path


def _deflated_zeros(size: int) -> bytes:
    """A raw deflate stream of ``size`` zero bytes (a multiple of 1 MiB),
    about 1/1000 of that: one compressed MiB, repeated (a full flush
    resets the compressor, so every MiB compresses alike), then an empty
    final block."""
    mib = 1 << 20
    assert size % mib == 0
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(bytes(mib)) + comp.flush(zlib.Z_FULL_FLUSH)
    return block * (size // mib) + b'\x03\x00'


def _zeros_crc(size: int) -> int:
    mib, crc = bytes(1 << 20), 0
    for _ in range(size >> 20):
        crc = zlib.crc32(mib, crc)
    return crc


def write_zip(path: str, records: Dict[str, bytes],
              zeros: Optional[Dict[str, int]] = None) -> str:
    """A zip written by hand: ``records`` stored as given, and a deflated
    record of ``zeros[name]`` zero bytes for each name in ``zeros`` (a
    decompression bomb, about 1/1000 of its size in the file)."""
    entries = [(n, 0, d, zlib.crc32(d), len(d)) for n, d in records.items()]
    entries += [(n, 8, _deflated_zeros(k), _zeros_crc(k), k)
                for n, k in (zeros or {}).items()]
    central, offset = b'', 0
    with open(path, 'wb') as out:
        for name, method, data, crc, size in entries:
            raw = name.encode()
            fields = struct.pack('<HHHHHIIIHH', 20, 0, method, 0, 0x21, crc,
                                 len(data), size, len(raw), 0)
            out.write(b'PK\x03\x04' + fields + raw + data)
            central += (b'PK\x01\x02' + struct.pack('<H', 20) + fields +
                        struct.pack('<HHHII', 0, 0, 0, 0, offset) + raw)
            offset += 30 + len(raw) + len(data)
        out.write(central + b'PK\x05\x06' + struct.pack(
            '<HHHHIIH', 0, 0, len(entries), len(entries), len(central),
            offset, 0))
    return path


def data_pickle(path: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(
            [n for n in archive.namelist() if n.endswith('/data.pkl')][0])


def touch_marker(path: str) -> None:
    """What a malicious checkpoint would run; a test checks it never does
    (it writes a marker file)."""
    with open(path, 'w') as f:
        f.write('ran')


def save_mmengine_checkpoint(path: str) -> str:
    """A checkpoint as mmengine's Runner writes it: a state dict, meta and
    a message hub holding HistoryBuffers, through
    ``mmengine.runner.save_checkpoint``."""
    import numpy as np
    import torch
    from mmengine.logging import MessageHub
    from mmengine.runner import save_checkpoint

    hub = MessageHub.get_instance(f'crafted-{osp.basename(path)}')
    for step in range(3):
        hub.update_scalar('train/loss', 1.0 / (step + 1))
        hub.update_scalar('train/lr', np.float64(0.01))
    hub.update_info('iter', 3)
    checkpoint = dict(
        meta=dict(iter=3, seed=np.int64(7), mmengine_version='0.10.7',
                  dataset_meta=dict(classes=('a', 'b'),
                                    palette=[[0, 0, 0], [1, 2, 3]])),
        state_dict={'conv.weight': torch.arange(6.).reshape(1, 1, 2, 3),
                    'conv.bias': torch.zeros(1)},
        message_hub=hub.state_dict())
    save_checkpoint(checkpoint, path)
    return path


# ------------------------------------------------------ the child process
def load_in_child(paths: Sequence[str], marker: str,
                  trust: Sequence[str] = (), loader: str = 'plugin',
                  timeout: float = 120) -> List[Dict]:
    """Load each file in a fresh process (one for the batch, a new one
    after a crash).

    Args:
        paths: the files.
        marker: the file a crafted payload would create if code ran.
        trust: names given to ``trust_checkpoint_types`` first.
        loader: 'plugin':
            ``mmseg_gf.engine.checkpoint.safe_load.load_checkpoint_file``;
            'torch': plain ``torch.load(weights_only=True)`` after
            ``import mmseg_gf`` (what mmseg's own tools do with the plugin
            imported).
        timeout: seconds for each process.

    Returns:
        One record per file: ``outcome`` ('refused': the loader raised its
        refusal, for 'torch' any exception; 'data': plain data, printed in
        full; 'error': anything else; 'signal N': the process died of
        signal N while loading it), ``detail``, ``marker`` (the marker file
        exists), ``class_state_kept``.
    """
    env = dict(os.environ, PYTHONPATH=REPO)
    records: List[Dict] = []
    todo = list(paths)
    while todo:
        proc = subprocess.run(
            [sys.executable, '-m', 'tests.helpers.crafted_checkpoints',
             marker, json.dumps(list(trust)), loader],
            input='\n'.join(todo), capture_output=True, text=True, env=env,
            cwd=REPO, timeout=timeout)
        lines = [json.loads(line) for line in proc.stdout.splitlines()
                 if line.startswith('{')]
        done = [r for r in lines if 'outcome' in r]
        records += done
        if proc.returncode == 0:
            assert len(done) == len(todo), proc.stderr[-2000:]
            break
        started = [r['start'] for r in lines if 'start' in r]
        assert proc.returncode < 0 and len(started) == len(done) + 1, (
            f'the loading process failed ({proc.returncode}): '
            f'{proc.stderr[-2000:]}')
        records.append({'path': started[-1], 'marker': osp.exists(marker),
                        'outcome': f'signal {-proc.returncode}',
                        'detail': proc.stderr[-500:],
                        'class_state_kept': None})
        todo = todo[len(started):]
    return records


def _allowed_objects() -> list:
    """What the allow-list maps names to (torch's own and the added)."""
    import torch
    from torch._weights_only_unpickler import _get_allowed_globals
    added = [e[0] if isinstance(e, tuple) else e
             for e in torch.serialization.get_safe_globals()]
    return list(_get_allowed_globals().values()) + added


def _plain_problem(obj, seen=None) -> Optional[str]:
    """None if ``obj`` is plain data (what a checkpoint may hold), else
    what is not."""
    import collections

    import numpy as np
    import torch
    from mmengine.logging import HistoryBuffer

    try:
        from mmseg_gf.engine.checkpoint.data import CheckedDtype
    except ImportError:  # a version of the plugin without it
        CheckedDtype = np.dtype
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    if any(obj is allowed for allowed in _allowed_objects()):
        return None  # a reference to an allow-listed name, not a call
    leaf = (str, bytes, bytearray, int, float, complex, bool, type(None),
            torch.Size, torch.device, torch.dtype, torch.layout,
            torch.memory_format, torch.qscheme, torch.UntypedStorage,
            torch.TypedStorage)
    if isinstance(obj, leaf):
        return None
    if isinstance(obj, torch.Tensor):
        return None if type(obj) in (torch.Tensor,
                                     torch.nn.Parameter) else repr(type(obj))
    if isinstance(obj, (np.dtype, CheckedDtype)):
        dt = obj.dtype if isinstance(obj, CheckedDtype) else obj
        plain = dt.kind in 'biufcSU' and dt.fields is None and \
            not dt.hasobject and dt.flags == np.dtype(dt.str).flags
        return None if plain else f'dtype {dt!r}'
    if isinstance(obj, (np.ndarray, np.generic)):
        return _plain_problem(obj.dtype, seen)
    if type(obj) is HistoryBuffer or isinstance(obj, HistoryBuffer):
        if set(vars(obj)) - {'max_length', '_log_history',
                             '_count_history'}:
            return f'HistoryBuffer attributes {sorted(vars(obj))}'
        return _plain_problem(list(vars(obj).values()), seen)
    if type(obj) in (dict, collections.OrderedDict, collections.Counter):
        for k, v in obj.items():
            problem = _plain_problem(k, seen) or _plain_problem(v, seen)
            if problem:
                return problem
        return None
    if type(obj) in (list, tuple, set, frozenset):
        for v in obj:
            problem = _plain_problem(v, seen)
            if problem:
                return problem
        return None
    return f'a {type(obj).__module__}.{type(obj).__qualname__}'


def _class_state():
    """What a load must not change: HistoryBuffer's class-wide table and
    attributes, numpy's built-in float64 / object dtypes."""
    import numpy as np
    from mmengine.logging import HistoryBuffer
    return (sorted((k, id(v))
                   for k, v in HistoryBuffer._statistics_methods.items()),
            sorted(vars(HistoryBuffer)),
            repr(np.dtype('f8').__reduce__()),
            repr(np.dtype('O').__reduce__()))


def _child_main(marker: str, trust: List[str], loader: str) -> None:
    import traceback

    import torch

    import mmseg_gf  # noqa: F401  (allow-lists what it allows)
    from mmseg_gf.engine.checkpoint import safe_load
    if trust:
        safe_load.trust_checkpoint_types(trust)
    before = _class_state()
    for path in sys.stdin.read().split('\n'):
        if not path:
            continue
        print(json.dumps({'start': path}), flush=True)
        try:
            if loader == 'torch':
                try:
                    result = torch.load(path, weights_only=True)
                except Exception as err:  # noqa: B902 (any: a refusal)
                    raise safe_load.RefusedCheckpointError(
                        f'{type(err).__name__}: {err}') from None
            else:
                result = safe_load.load_checkpoint_file(path)
        except safe_load.RefusedCheckpointError as err:
            cause = err.__cause__ or err.__context__
            # Our own checks must refuse, never fail on their own.
            frames = traceback.extract_tb(cause.__traceback__) if cause \
                else []
            own = [f for f in frames if 'checkpoint/data.py' in f.filename]
            ours_broke = cause is not None and own and not isinstance(
                cause, safe_load.RefusedCheckpointError) and \
                not isinstance(cause.__cause__ or cause.__context__,
                               safe_load.RefusedCheckpointError)
            record = {'outcome': 'error' if ours_broke else 'refused',
                      'detail': f'{str(err)[:300]}'
                      + (f' <- {type(cause).__name__}: {cause}'
                         if ours_broke else '')}
        except Exception as err:  # noqa: B902 (reported to the test)
            record = {'outcome': 'error',
                      'detail': f'{type(err).__name__}: {str(err)[:300]}'}
        else:
            try:
                problem = _plain_problem(result)
                repr(result)  # reads every value: a bad pointer crashes
            except Exception as err:  # noqa: B902 (reported to the test)
                problem = f'{type(err).__name__}: {str(err)[:300]}'
            record = {'outcome': 'data' if problem is None else 'error',
                      'detail': problem or ''}
        record['path'] = path
        record['marker'] = osp.exists(marker)
        record['class_state_kept'] = _class_state() == before
        print(json.dumps(record), flush=True)


if __name__ == '__main__':
    _child_main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
