"""What the tools' command lines share: mmseg's common flags, trusted
checkpoint types, and writing ``--out`` json.
"""
import argparse
import json
import os
import os.path as osp
import shlex
import sys
from typing import Optional, Sequence

from mmengine.config import DictAction

from .checkpoint.safe_load import TRUST_FLAG, trust_checkpoint_types

__all__ = [
    'add_common_args', 'add_trust_argument', 'apply_common_args',
    'export_local_rank', 'write_json', 'command_line', 'write_report'
]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--cfg-options``, ``--launcher``, ``--local-rank``,
    ``--trust-checkpoint-type``."""
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
    add_trust_argument(parser)


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-checkpoint-type``, repeatable."""
    parser.add_argument(
        TRUST_FLAG,
        dest='trust_checkpoint_types',
        action='append',
        default=[],
        metavar='TYPE',
        help='allow this type (dotted name) in checkpoints; checkpoints are '
        'loaded with torch.load(weights_only=True), which refuses types '
        'that are not data (their loading could run code) through the '
        "plugin's checks. Give it only for a file you trust, with the name "
        'its refusal printed; repeatable')


def apply_common_args(args: argparse.Namespace) -> None:
    """Export ``LOCAL_RANK`` and trust the named checkpoint types."""
    export_local_rank(args)
    trust_checkpoint_types(args.trust_checkpoint_types)


def export_local_rank(args: argparse.Namespace) -> None:
    """Export ``--local-rank`` as ``LOCAL_RANK`` when the launcher did not."""
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)


def write_json(path: str, obj) -> None:
    """Write a tool's ``--out`` file (creating its directory) and say so."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(obj, f, indent=2)
    print(f'wrote {path}')


def command_line(tool: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command that ran ``tools/<tool>.py`` with ``argv`` (default: the
    process's own arguments), as a report quotes it."""
    args = sys.argv[1:] if argv is None else argv
    return ' '.join([f'python tools/{tool}.py'] +
                    [shlex.quote(a) for a in args])


def write_report(json_path: str, payload, markdown: str) -> None:
    """A benchmark's ``--out``: ``payload`` as JSON at ``json_path`` and
    ``markdown`` beside it (the same name ending in ``.md``)."""
    write_json(json_path, payload)
    with open(osp.splitext(json_path)[0] + '.md', 'w') as f:
        f.write(markdown)
