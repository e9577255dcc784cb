"""What loading a checkpoint file may cost, bounded before anything is built.

Allow-listed names can still build a lot from a few bytes; so the file's
declared cost (records, tensors, sized constructors, objects) is added up
first and refused past the larger of ``factor`` x its size (default 4) and
``floor`` (64 MiB) (docs/reliability.md#what-a-file-may-cost).
"""
import os
import pickletools
import zipfile
import zlib
from typing import List, Optional, Tuple

from ...ops.backend import switches
from .data import RefusedCheckpointError, refusal
from .pickle_scan import PickleScan, data_pickle_info, scan_pickle

__all__ = ['set_load_limit', 'load_cap', 'read_checkpoint', 'check_cost',
           'scan_checkpoint',
           'DEFAULT_FACTOR', 'DEFAULT_FLOOR_BYTES', 'FACTOR_ENV']

FACTOR_ENV = 'MMSEG_GF_CHECKPOINT_COST_FACTOR'
_FLOOR = 'checkpoint_floor_bytes'
DEFAULT_FACTOR = switches.SWITCHES[FACTOR_ENV].default
DEFAULT_FLOOR_BYTES = switches.SWITCHES[_FLOOR].default
#: Record compressions torch's zip reader reads.
_READABLE = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)


def set_load_limit(factor: Optional[float] = None,
                   floor_bytes: Optional[int] = None) -> Tuple[float, int]:
    """Set what a checkpoint may declare: max(``factor`` x file size,
    ``floor_bytes``).

    None keeps a value.

    Returns:
        the previous ``(factor, floor_bytes)``.

    Raises:
        ValueError: a factor < 1 or a floor < 0 (named).
    """
    previous = (_factor(), _floor())
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(
                factor, (int, float)) or not factor >= 1:
            raise ValueError('checkpoint load limit factor must be a number '
                             f'>= 1 (times the file size), got {factor!r}')
        switches.set_value(FACTOR_ENV, float(factor))
    if floor_bytes is not None:
        if isinstance(floor_bytes, bool) or not isinstance(
                floor_bytes, int) or floor_bytes < 0:
            raise ValueError('checkpoint load limit floor_bytes must be an '
                             f'int >= 0, got {floor_bytes!r}')
        switches.set_value(_FLOOR, floor_bytes)
    return previous


def _factor() -> float:
    """The factor set at run time, else the environment's, else 4."""
    return switches.value(FACTOR_ENV)


def _floor() -> int:
    return switches.value(_FLOOR)


def load_cap(file_size: int) -> int:
    """The most a file of ``file_size`` bytes may declare."""
    return max(int(_factor() * file_size), _floor())


def _mib(n: int) -> str:
    return f'{n / 2**20:.1f} MiB'


def _too_costly(what: str, cost: int, file_size: int,
                cap: int) -> RefusedCheckpointError:
    return RefusedCheckpointError(
        f'checkpoint refused: it declares {what} of {_mib(cost)} in a file '
        f'of {_mib(file_size)}, more than the loader\'s cap of {_mib(cap)} '
        f'(the larger of {_factor():g} x the file size and '
        f'{_mib(_floor())}; allowed: a checkpoint as torch.save '
        'writes it, which declares about its own size). For a file you '
        'trust, raise the cap: '
        'mmseg_gf.engine.checkpoint.load_bounds.set_load_limit('
        f'factor=..., floor_bytes=...) or {FACTOR_ENV}=...')


def _check_records(infos: List[zipfile.ZipInfo], file_size: int,
                   cap: int) -> int:
    """The records' total uncompressed size, refused past the cap or in an
    unread compression."""
    for info in infos:
        if info.compress_type not in _READABLE:
            raise refusal(
                f'a zip record {info.filename!r} compressed with method '
                f'{info.compress_type}', "torch's zip reader reads stored "
                'and deflated records only')
    total = sum(info.file_size for info in infos)
    if total > cap:
        raise _too_costly('zip records', total, file_size, cap)
    return total


def read_checkpoint(filename: str
                    ) -> Optional[Tuple[bytes, List[zipfile.ZipInfo]]]:
    """The pickle and records of a zip checkpoint, sizes checked before
    decompression.

    None for another format (left to torch).

    Raises:
        OSError: the file cannot be read.
        RefusedCheckpointError: records past the cap, a damaged archive,
            or a pickle that does not fit in memory.
    """
    if not zipfile.is_zipfile(filename):
        return None
    file_size = os.path.getsize(filename)
    try:
        with zipfile.ZipFile(filename) as archive:
            infos = archive.infolist()
            _check_records(infos, file_size, load_cap(file_size))
            info = data_pickle_info(archive)
            if info is None:
                return None
            return archive.read(info), infos
    except (zipfile.BadZipFile, zlib.error, EOFError,
            NotImplementedError) as err:
        raise refusal(f'a damaged zip archive ({type(err).__name__}: '
                      f'{str(err)[:200]})',
                      'it is not a readable checkpoint') from None
    except MemoryError:
        raise refusal('a pickle that does not fit in memory',
                      'it is not a checkpoint of tensors and plain '
                      'data') from None


def check_cost(filename: str, scan: PickleScan,
               infos: Optional[List[zipfile.ZipInfo]]) -> None:
    """Refuse a file whose declarations exceed the cap or cannot be bounded.

    Raises:
        RefusedCheckpointError: naming what and how much.
    """
    if scan.problem is not None:
        raise refusal(scan.problem, 'torch.save writes every size as '
                      'numbers')
    if infos is None:  # legacy format
        records = sum(scan.storages.values())
    else:
        sizes = {info.filename: info.file_size for info in infos}
        prefix = next(iter(sizes)).split('/')[0] + '/' if sizes else ''
        for key, nbytes in scan.storages.items():
            record = sizes.get(f'{prefix}data/{key}')
            if record is not None and nbytes > record:
                raise refusal(
                    f'a storage {key!r} declared as {nbytes} bytes whose '
                    f'record holds {record}', 'a storage must fit in its '
                    'record')
        records = sum(sizes.values())
    file_size = os.path.getsize(filename)
    cost = records + scan.built_bytes
    cap = load_cap(file_size)
    if cost > cap:
        raise _too_costly('contents (storages, tensors, bytearrays and '
                          'objects)', cost, file_size, cap)


def _scan(data) -> PickleScan:
    try:
        return scan_pickle(data)
    except MemoryError:
        raise refusal('a pickle that does not fit in memory',
                      'it is not a checkpoint of tensors and plain '
                      'data') from None


def _scan_legacy(filename: str) -> Optional[PickleScan]:
    """The scanned data pickle of a legacy-format file, or None."""
    with open(filename, 'rb') as f:
        if f.read(1) != b'\x80':
            return None
        f.seek(0)
        try:
            for _ in range(3):
                for _ in pickletools.genops(f):
                    pass
        except (ValueError, EOFError):
            return None
        return _scan(f)


def scan_checkpoint(filename: str
                    ) -> Optional[Tuple[PickleScan,
                                        Optional[List[zipfile.ZipInfo]]]]:
    """The file's data pickle scanned, with its zip records; None for another
    format."""
    read = read_checkpoint(filename)
    if read is not None:
        return _scan(read[0]), read[1]
    if zipfile.is_zipfile(filename):
        return None
    legacy = _scan_legacy(filename)
    return None if legacy is None else (legacy, None)
