"""Plot mIoU against backward GFLOPs from a protocol run's results.csv.

The README's figure is made from the reduced CPU protocol's measured
results::

    python tools/plot_results.py docs/protocol_cpu/results.csv \
        --out docs/figures/miou_vs_backward_gflops.png \
        --title 'PSPNet-R18, Cityscapes -> VOC12Aug (reduced CPU protocol)'

The points are the table's final-iteration mIoU (mean and sample std over
the seeds) at each strategy's backward GFLOPs per image, as
``tools/run_protocol.py`` plots them (``mmseg_gf.protocol.report``).
"""
import argparse
import os
import sys
from typing import List, Optional

from mmseg_gf.protocol.report import plot_results_csv


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('csv', help="a protocol run's results.csv")
    parser.add_argument('--out', required=True, help='the PNG to write')
    parser.add_argument('--title', default='', help='the plot title')
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if plot_results_csv(args.csv, args.out, args.title) is None:
        print('matplotlib is not installed', file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
