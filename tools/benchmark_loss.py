"""Time and peak memory of a decode loss: mmseg's upsample + cross-entropy
under autograd against the resized cross-entropy (PyTorch path, compiled
kernel).

Example (Segformer-B0's ADE20K loss at 512x512, batch 2; the figures of
docs/lean_region.md)::

    python tools/benchmark_loss.py --classes 150 --logits 128 128 \
        --label 512 512 --batch 2 --threads 1
    # Fast-SCNN's sigmoid loss on Cityscapes' 19 classes at 1/8
    python tools/benchmark_loss.py --classes 19 --logits 64 64 \
        --label 512 512 --batch 2 --sigmoid --threads 1

Each way computes the loss and its gradient w.r.t. the low-resolution
logits; the ways run interleaved, repetition by repetition. Prints the
median seconds, the speedup over autograd and the peak of live tensor
bytes; ``--out`` writes the rows as json.
"""
import argparse
import json
import torch

from mmseg_gf.analysis.hardware import cpu_model
from mmseg_gf.analysis.loss_benchmark import benchmark_loss, loss_table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--classes', type=int, default=150)
    parser.add_argument('--logits', type=int, nargs=2, default=[128, 128],
                        metavar=('h', 'w'), help='logits size')
    parser.add_argument('--label', type=int, nargs=2, default=[512, 512],
                        metavar=('H', 'W'), help='label size')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--sigmoid', action='store_true',
                        help='per-class binary cross-entropy (one-hot '
                        'labels), as mmseg\'s use_sigmoid=True')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--no-memory', action='store_true',
                        help='times only')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch CPU threads (default: torch\'s choice)')
    parser.add_argument('--out', default=None, help='json file of the rows')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = benchmark_loss(args.batch, args.classes, args.logits, args.label,
                          args.sigmoid, args.repeats, args.warmup,
                          not args.no_memory)
    kind = 'sigmoid' if args.sigmoid else 'softmax'
    print(f'{kind} cross-entropy, logits {args.batch}x{args.classes}x'
          f'{args.logits[0]}x{args.logits[1]} -> {args.label[0]}x'
          f'{args.label[1]}, {torch.get_num_threads()} threads, torch '
          f'{torch.__version__}, {cpu_model()}'
          f'; median of {args.repeats}')
    print(loss_table(rows))
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(dict(vars(args), cpu=cpu_model(), rows=rows), f,
                      indent=2)
    return rows


if __name__ == '__main__':
    main()
