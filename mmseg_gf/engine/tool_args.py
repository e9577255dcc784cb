"""What the tools' command lines share: mmseg's common flags of
tools/train.py and tools/test.py, trusting mmengine's checkpoint format,
writing a tool's ``--out`` json.

The tools follow mmseg 1.x's scripts flag for flag; the runs themselves are
in :mod:`mmseg_gf.engine.entrypoints`.
"""
import argparse
import json
import os
import os.path as osp

from mmengine.config import DictAction

__all__ = [
    'trust_mmengine_checkpoints', 'add_common_args', 'export_local_rank',
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


def export_local_rank(args: argparse.Namespace) -> None:
    """Export ``--local-rank`` as ``LOCAL_RANK`` when the launcher did not
    (``torch.distributed.launch`` passes the flag; mmengine reads the
    variable)."""
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)


def write_json(path: str, obj) -> None:
    """Write a tool's ``--out`` file (creating its directory) and say so."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(obj, f, indent=2)
    print(f'wrote {path}')

