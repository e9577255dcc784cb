"""Export a checkpoint's weights into a file plain mmseg loads.

Writes only tensors and plain Python data: the state dict under mmseg's
keys and ``meta`` (dataset classes and palette, the config text if the
checkpoint holds it, the mmseg / mmengine / torch versions). mmseg's own
``init_model`` and ``tools/test.py`` (mmengine's ``load_checkpoint``, with
torch's default ``weights_only=True``) load it without this plugin, which a
Runner's training checkpoint (holding mmengine's ``HistoryBuffer``) needs on
torch >= 2.6. The logic is
:func:`mmseg_gf.engine.checkpoint.weights_export.export_weights`.

Example::

    python tools/export_weights.py work_dirs/psp_r18_r4/iter_20000.pth \
        psp_r18_r4_weights.pth
"""
import argparse
import sys
from typing import List, Optional

import mmseg_gf  # noqa: F401  (allow-lists mmengine checkpoints' types)
from mmseg_gf.engine.tool_args import add_trust_argument
from mmseg_gf.engine.checkpoint.weights_export import export_weights


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Export a checkpoint as tensors and plain data that '
        'plain mmseg loads (torch.load weights_only=True, no plugin)')
    parser.add_argument('checkpoint', help='checkpoint file (e.g. a '
                        "Runner's iter_N.pth)")
    parser.add_argument('out', help='the file to write')
    add_trust_argument(parser)
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    summary = export_weights(args.checkpoint, args.out,
                             trust=args.trust_checkpoint_types)
    print(f"wrote {args.out}: {summary['keys']} tensors, meta "
          f"{', '.join(summary['meta'])}")
    if summary['left_out']:
        print('left out (not plain data): '
              + ', '.join(summary['left_out']))
    return summary


if __name__ == '__main__':
    main(sys.argv[1:])
