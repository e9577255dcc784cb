"""Checkpoints survive a cut: atomic writes through mmengine's file backend
and CheckpointHook (mmseg_gf/engine/checkpoint/atomic_write.py), and a
resume that skips a checkpoint that does not load
(mmseg_gf/engine/checkpoint/resume.py)."""
import logging
import os
import os.path as osp
from collections import deque
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402
from mmengine.fileio import get_file_backend  # noqa: E402
from mmengine.fileio.backends import LocalBackend  # noqa: E402
from mmengine.hooks import CheckpointHook  # noqa: E402
from mmengine.logging import MessageHub  # noqa: E402
from mmengine.runner.checkpoint import save_checkpoint  # noqa: E402

import mmseg_gf  # noqa: E402,F401  (installs the atomic writes)
from mmseg_gf.analysis.fault_child import child_context  # noqa: E402
from mmseg_gf.analysis.fault_injection import kill_inside_write  # noqa
from mmseg_gf.engine.checkpoint import atomic_write  # noqa: E402
from mmseg_gf.engine.checkpoint.atomic_write import (  # noqa: E402
    PARTIAL_PREFIX, atomic_write_bytes, install_atomic_checkpoints,
    uninstall_atomic_checkpoints)
from mmseg_gf.engine import GradFilterHook  # noqa: E402
from mmseg_gf.engine.entrypoints import resolve_resume  # noqa: E402
from mmseg_gf.engine.checkpoint.resume import (  # noqa: E402
    NoResumableCheckpoint, find_resumable_checkpoint)
from mmseg_gf.engine.checkpoint.safe_load import (  # noqa: E402
    RefusedCheckpointError, load_checkpoint_file)


def _checkpoint(path, step):
    save_checkpoint(dict(meta=dict(iter=step),
                         state_dict={'w': torch.full((4096,), float(step))}),
                    path)


def _step(path):
    return int(load_checkpoint_file(path)['meta']['iter'])


def test_importing_the_plugin_installs_the_writes_with_an_undo():
    assert LocalBackend.__dict__['put'] is atomic_write._put
    assert CheckpointHook.__dict__['_save_checkpoint_with_step'] is \
        atomic_write._save_checkpoint_with_step
    uninstall_atomic_checkpoints()
    try:
        assert LocalBackend.__dict__['put'].__module__.startswith('mmengine')
        assert CheckpointHook.__dict__['_save_checkpoint_with_step'] \
            .__module__.startswith('mmengine')
    finally:
        install_atomic_checkpoints()
    assert LocalBackend.__dict__['put_text'] is atomic_write._put_text


def test_write_goes_through_a_temporary_file_and_a_rename(tmp_path,
                                                         monkeypatch):
    seen = []
    replace = os.replace

    def watched(src, dst):
        seen.append((osp.basename(src), osp.basename(dst),
                     open(src, 'rb').read()))
        replace(src, dst)

    monkeypatch.setattr(atomic_write.os, 'replace', watched)
    target = tmp_path / 'sub' / 'iter_3.pth'
    get_file_backend(str(target)).put(b'abc' * 1000, str(target))
    (temp, dst, data), = seen
    assert temp.startswith(PARTIAL_PREFIX + 'iter_3.pth.') and \
        dst == 'iter_3.pth' and data == b'abc' * 1000
    assert target.read_bytes() == b'abc' * 1000
    assert os.listdir(target.parent) == ['iter_3.pth']


def _write_and_die(path, fraction):
    """Child: write a new checkpoint over ``path``, killed inside the
    write after ``fraction`` of its bytes."""
    kill_inside_write(1, fraction)
    _checkpoint(path, 2)


def test_crash_between_write_and_rename_leaves_the_old_file(tmp_path):
    path = str(tmp_path / 'iter_1.pth')
    _checkpoint(path, 1)
    before = open(path, 'rb').read()
    child = child_context().Process(
        target=_write_and_die, args=(path, 1.0))
    child.start()
    child.join(120)
    assert child.exitcode == -9  # SIGKILL, after every byte, before rename
    assert open(path, 'rb').read() == before and _step(path) == 1
    partial = [n for n in os.listdir(tmp_path) if n != 'iter_1.pth']
    assert len(partial) == 1 and partial[0].startswith(PARTIAL_PREFIX)
    (tmp_path / 'last_checkpoint').write_text(path)
    assert find_resumable_checkpoint(str(tmp_path)) == path
    assert sorted(os.listdir(tmp_path)) == ['iter_1.pth', 'last_checkpoint']


class _Runner:
    """What CheckpointHook._save_checkpoint_with_step uses of a Runner; its
    save_checkpoint records which files exist while it writes."""

    def __init__(self, work_dir):
        self.work_dir = work_dir
        self.message_hub = MessageHub.get_instance('test_atomic_ckpt')
        self.present_during_save = []

    def save_checkpoint(self, out_dir, filename, *args, **kwargs):
        self.present_during_save.append(sorted(os.listdir(out_dir)))
        _checkpoint(osp.join(out_dir, filename), int(filename[5:-4]))


def _hook(work_dir, keep):
    hook = CheckpointHook(interval=1, by_epoch=False, max_keep_ckpts=keep)
    hook.out_dir = work_dir
    hook.file_backend = get_file_backend(work_dir)
    hook.filename_tmpl = 'iter_{}.pth'
    hook.keep_ckpt_ids = deque([], keep)
    return hook


@pytest.mark.parametrize('keep', [1, 2])
def test_outdated_checkpoint_deleted_only_after_the_new_one(tmp_path, keep):
    work = str(tmp_path)
    runner, hook = _Runner(work), _hook(work, keep)
    for step in (1, 2, 3):
        hook._save_checkpoint_with_step(runner, step, dict(iter=step))
        assert (tmp_path / 'last_checkpoint').read_text() == \
            osp.join(work, f'iter_{step}.pth')
    # while iter_N was written, the last good file was still there
    files = [[n for n in names if n.startswith('iter_')]
             for names in runner.present_during_save]
    assert files == [[], ['iter_1.pth'],
                     ['iter_2.pth'] if keep == 1 else ['iter_1.pth',
                                                       'iter_2.pth']]
    kept = sorted(n for n in os.listdir(work) if n.startswith('iter_'))
    assert kept == ['iter_3.pth'] if keep == 1 else \
        kept == ['iter_2.pth', 'iter_3.pth']
    assert runner.message_hub.get_info('keep_ckpt_ids') == \
        list(range(4 - keep, 4))


def test_mmengine_order_deletes_before_the_save(tmp_path):
    """Without the plugin's hook method the last good file is gone while
    the new one is written (what the test above guards against)."""
    work = str(tmp_path)
    runner, hook = _Runner(work), _hook(work, 1)
    uninstall_atomic_checkpoints()
    try:
        for step in (1, 2):
            hook._save_checkpoint_with_step(runner, step, dict(iter=step))
    finally:
        install_atomic_checkpoints()
    assert [n for n in runner.present_during_save[1]
            if n.startswith('iter_')] == []


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _work_dir(tmp_path, steps, last):
    for step in steps:
        _checkpoint(str(tmp_path / f'iter_{step}.pth'), step)
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / last))
    logger = logging.getLogger(f'test_resume_{tmp_path.name}')
    records = _Records()
    logger.addHandler(records)
    return logger, records


@pytest.mark.parametrize('damage', ['truncated', 'empty', 'garbage'])
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, damage):
    logger, records = _work_dir(tmp_path, (3, 6, 9), 'iter_9.pth')
    newest = tmp_path / 'iter_9.pth'
    data = newest.read_bytes()
    newest.write_bytes({'truncated': data[:len(data) // 2], 'empty': b'',
                        'garbage': b'not a checkpoint' * 8}[damage])
    found = find_resumable_checkpoint(str(tmp_path), logger=logger)
    # the previous checkpoint: the cut costs the iterations since it
    assert found == str(tmp_path / 'iter_6.pth') and _step(found) == 6
    warnings = [r for r in records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert str(newest) in message and 'iter_6.pth' in message
    assert 'iter_3.pth' not in message


def test_resume_skips_every_damaged_file_in_one_warning(tmp_path):
    logger, records = _work_dir(tmp_path, (3, 6, 9), 'iter_9.pth')
    for step in (9, 6):
        (tmp_path / f'iter_{step}.pth').write_bytes(b'PK\x03\x04 cut')
    found = find_resumable_checkpoint(str(tmp_path), logger=logger)
    assert found == str(tmp_path / 'iter_3.pth')
    (warning,) = [r.getMessage() for r in records.records
                  if r.levelno == logging.WARNING]
    assert 'skipped 2 checkpoint(s)' in warning and 'iter_9.pth' in \
        warning and 'iter_6.pth' in warning


def test_resume_of_a_good_checkpoint_warns_nothing(tmp_path):
    logger, records = _work_dir(tmp_path, (3, 6), 'iter_6.pth')
    assert find_resumable_checkpoint(str(tmp_path), logger=logger) == \
        str(tmp_path / 'iter_6.pth')
    assert not [r for r in records.records if r.levelno >= logging.WARNING]


def test_resume_without_anything_loadable_names_every_file(tmp_path):
    _work_dir(tmp_path, (3, 6), 'iter_6.pth')
    for step in (3, 6):
        (tmp_path / f'iter_{step}.pth').write_bytes(b'')
    # a refusal stays a refusal, naming every file tried
    with pytest.raises(RefusedCheckpointError,
                       match=r'checkpoint refused: .*tried .*iter_6\.pth, '
                       r'.*iter_3\.pth'):
        find_resumable_checkpoint(str(tmp_path))
    (tmp_path / 'last_checkpoint').write_text('')
    for step in (3, 6):
        os.unlink(tmp_path / f'iter_{step}.pth')
    with pytest.raises(NoResumableCheckpoint,
                       match='last_checkpoint is empty'):
        find_resumable_checkpoint(str(tmp_path))
    assert find_resumable_checkpoint(str(tmp_path / 'fresh')) is None


def test_atomic_write_leaves_no_partial_file_on_an_error(tmp_path,
                                                         monkeypatch):
    target = tmp_path / 'iter_1.pth'
    target.write_bytes(b'old')

    def failing(file, data, path):
        file.write(data[:3])
        raise OSError('disk full')

    monkeypatch.setattr(atomic_write, 'write_chunks', failing)
    with pytest.raises(OSError, match='disk full'):
        atomic_write_bytes(b'new contents', str(target))
    assert os.listdir(tmp_path) == ['iter_1.pth']
    assert target.read_bytes() == b'old'


def test_both_resume_paths_take_the_newest_checkpoint_that_loads(tmp_path):
    """tools/train.py --resume (resolve_resume) and a config's resume=True
    with GradFilterHook (before_run names the file for load_or_resume)."""
    logger, records = _work_dir(tmp_path, (3, 6), 'iter_6.pth')
    (tmp_path / 'iter_6.pth').write_bytes(b'PK\x03\x04 cut')
    cfg = resolve_resume(Config(dict(work_dir=str(tmp_path),
                                     load_from='pretrained.pth')), True)
    assert cfg.resume and cfg.load_from == str(tmp_path / 'iter_3.pth')
    runner = SimpleNamespace(cfg=None, _load_from=None, _resume=True,
                             work_dir=str(tmp_path), logger=logger)
    GradFilterHook(check_load_from=False).before_run(runner)
    assert runner._load_from == str(tmp_path / 'iter_3.pth')
    (warning,) = [r.getMessage() for r in records.records
                  if r.levelno == logging.WARNING]
    assert 'iter_6.pth' in warning
