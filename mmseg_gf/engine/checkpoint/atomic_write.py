"""Checkpoints on the local disk written so that a cut leaves the old file
or the new one, never a part of one.

Every write goes to a hidden temporary file in the same folder, is
``fsync``-ed and renamed into place; ``CheckpointHook`` deletes outdated
checkpoints only after the new one and ``last_checkpoint`` are complete.
Installed through :func:`~mmseg_gf.patching.override` (docs/patching.md);
what holds: docs/reliability.md#checkpoints-survive-a-cut.
"""
import contextlib
import os
import os.path as osp
import secrets
from typing import List, Optional

from mmengine.dist import is_main_process
from mmengine.fileio.backends import LocalBackend
from mmengine.hooks import CheckpointHook

from ...patching import Override, override

__all__ = ['PARTIAL_PREFIX', 'CHUNK_BYTES', 'write_chunks',
           'atomic_write_bytes', 'atomic_write_text', 'fsync_folder',
           'remove_partial_writes', 'install_atomic_checkpoints',
           'uninstall_atomic_checkpoints', 'atomic_checkpoints_installed']

#: Prefix of the temporary files; a file left by a cut during a write has
#: it (:func:`remove_partial_writes` deletes them).
PARTIAL_PREFIX = '.gf-partial-'
#: Bytes per ``write`` call (a checkpoint is written in parts of this size).
CHUNK_BYTES = 1 << 20


def write_chunks(file, data: bytes, path: str) -> None:
    """Write ``data`` to ``file`` in parts; looked up per call so fault
    injection can cut it."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK_BYTES):
        file.write(view[start:start + CHUNK_BYTES])


def fsync_folder(folder: str) -> None:
    """``fsync`` a folder so that a rename in it is on the disk (no-op where
    unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, 'O_DIRECTORY', 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Write ``data`` to ``path`` through a temporary file, ``fsync`` and
    rename.

    Until the rename ``path`` holds what it held; the folder is created if
    missing and the file gets ``open(path, 'wb')``'s mode.
    """
    folder = osp.dirname(osp.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temp = osp.join(folder, f'{PARTIAL_PREFIX}{osp.basename(path)}.'
                    f'{os.getpid()}.{secrets.token_hex(4)}')
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, 'wb') as file:
            write_chunks(file, data, path)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_folder(folder)


def atomic_write_text(text: str, path: str, encoding: str = 'utf-8') -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded."""
    atomic_write_bytes(text.encode(encoding), path)


def remove_partial_writes(folder: str) -> List[str]:
    """Delete the temporary files a cut left in ``folder``; returns their
    names."""
    if not osp.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(PARTIAL_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(osp.join(folder, name))
                removed.append(name)
    return removed


def _put(self, obj: bytes, filepath) -> None:
    """``LocalBackend.put`` written atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(obj, str(filepath))


def _put_text(self, obj: str, filepath, encoding: str = 'utf-8') -> None:
    """``LocalBackend.put_text`` written atomically."""
    atomic_write_text(obj, str(filepath), encoding)


def _remove_checkpoint(hook: CheckpointHook, step: int) -> None:
    """Delete the checkpoint of ``step`` (a file, or a DeepSpeed folder)."""
    path = hook.file_backend.join_path(hook.out_dir,
                                       hook.filename_tmpl.format(step))
    if hook.file_backend.isfile(path):
        hook.file_backend.remove(path)
    elif hook.file_backend.isdir(path):
        hook.file_backend.rmtree(path)


def _save_checkpoint_with_step(self, runner, step, meta) -> None:
    """mmengine 0.10.7's ``_save_checkpoint_with_step``, the outdated
    checkpoint deleted last."""
    outdated: Optional[int] = None
    if self.max_keep_ckpts > 0 and not (
            self.keep_ckpt_ids and self.keep_ckpt_ids[-1] == step):
        if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
            outdated = self.keep_ckpt_ids.popleft()
        self.keep_ckpt_ids.append(step)
        runner.message_hub.update_info('keep_ckpt_ids',
                                       list(self.keep_ckpt_ids))
    ckpt_filename = self.filename_tmpl.format(step)
    self.last_ckpt = self.file_backend.join_path(self.out_dir, ckpt_filename)
    runner.message_hub.update_info('last_ckpt', self.last_ckpt)
    runner.save_checkpoint(
        self.out_dir, ckpt_filename, self.file_client_args,
        save_optimizer=self.save_optimizer,
        save_param_scheduler=self.save_param_scheduler, meta=meta,
        by_epoch=self.by_epoch, backend_args=self.backend_args, **self.args)
    if not is_main_process():
        return
    atomic_write_text(self.last_ckpt,
                      osp.join(runner.work_dir, 'last_checkpoint'))
    if outdated is not None and outdated != step:
        _remove_checkpoint(self, outdated)


_UNDO: List[Override] = []


def atomic_checkpoints_installed() -> bool:
    """Whether :func:`install_atomic_checkpoints` is in effect."""
    return bool(_UNDO)


def install_atomic_checkpoints() -> None:
    """Make local checkpoint writes atomic; idempotent."""
    if _UNDO:
        return
    patches = ((LocalBackend, 'put', _put),
               (LocalBackend, 'put_text', _put_text),
               (CheckpointHook, '_save_checkpoint_with_step',
                _save_checkpoint_with_step))
    for owner, name, value in patches:
        _UNDO.append(override(owner, name, value))


def uninstall_atomic_checkpoints() -> None:
    """Give mmengine back its own writes."""
    while _UNDO:
        _UNDO.pop()()
