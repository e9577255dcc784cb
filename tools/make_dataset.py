"""Write a small synthetic dataset in a real dataset's on-disk layout.

Examples::

    python tools/make_dataset.py voc --out data/demo --num-train 96 --num-val 24 \
        --size 96 128 --classes 1 2 3 4 5
    python tools/make_dataset.py cityscapes --out data/cityscapes_syn
    python tools/make_dataset.py ade20k --out data/ade_syn --seed 1

``voc`` writes ``OUT/VOCdevkit/VOC2012``, ``cityscapes`` writes ``OUT``
(leftImg8bit/, gtFine/), ``ade20k`` writes ``OUT/ADEChallengeData2016``.
"""
import argparse
import sys
import time
from typing import List, Optional

from mmseg_gf.datasets import MAKERS


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('dataset', choices=sorted(MAKERS))
    parser.add_argument('--out', required=True, help='output root')
    parser.add_argument('--num-train', type=int, default=64)
    parser.add_argument('--num-val', type=int, default=16)
    parser.add_argument(
        '--size', type=int, nargs=2, metavar=('H', 'W'), default=None,
        help='image size (default: 128 128, cityscapes 128 256)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument(
        '--classes', type=int, nargs='+', default=None,
        help='object class ids that may appear (default: all)')
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    kwargs = dict(seed=args.seed, classes=args.classes)
    if args.size is not None:
        kwargs['size'] = tuple(args.size)
    start = time.time()
    root = MAKERS[args.dataset](args.out, args.num_train, args.num_val,
                                **kwargs)
    print(f'{args.dataset}: {args.num_train} train / {args.num_val} val '
          f'images written to {root} in {time.time() - start:.1f}s')
    return root


if __name__ == '__main__':
    main(sys.argv[1:])
