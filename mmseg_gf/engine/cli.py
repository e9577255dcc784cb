"""What tools/train.py and tools/test.py share: mmseg's common CLI flags,
loading a config with them, and trusting mmengine's checkpoint format.

Both tools follow mmseg 1.x's scripts flag for flag; only the parts that are
the same in both live here.
"""
import argparse
import json
import os
import os.path as osp

from mmengine.config import Config, DictAction

__all__ = [
    'trust_mmengine_checkpoints', 'add_common_args', 'load_config',
    'write_json'
]


def trust_mmengine_checkpoints() -> None:
    """Let ``torch.load`` read mmengine checkpoints again.

    mmengine 0.10.7 calls ``torch.load()`` without ``weights_only``; torch
    >= 2.6 defaults to ``weights_only=True`` and refuses mmengine's own
    checkpoints (their ``message_hub`` holds HistoryBuffer / numpy objects).
    The checkpoint comes from the command line or the config, which is
    itself executed Python, so it is trusted as much as the config: restore
    the pre-2.6 behaviour unless the user chose otherwise (the variable is
    only set when absent).
    """
    os.environ.setdefault('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--cfg-options``, ``--launcher`` and ``--local-rank``."""
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file. If the value to '
        'be overwritten is a list, it should be like key="[a,b]" or key=a,b; '
        'nested lists/tuples like key="[(a,b),(c,d)]". No white space.')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or
    # --local_rank (older).
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def load_config(args: argparse.Namespace) -> Config:
    """The config with the CLI's launcher, ``--cfg-options`` and work dir.

    Work dir: ``--work-dir`` > the config's ``work_dir`` >
    ``./work_dirs/<config name>``. Also exports ``LOCAL_RANK`` from
    ``--local-rank`` when the launcher did not.
    """
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])
    return cfg


def write_json(path: str, obj) -> None:
    """Write a tool's ``--out`` file (creating its directory) and say so."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(obj, f, indent=2)
    print(f'wrote {path}')

