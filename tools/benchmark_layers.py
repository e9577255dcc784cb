"""Per-layer benchmark: GFConv2d's backward vs torch's native conv backward
(and GFLinear's vs torch's Linear backward on token grids).

Example::

    python tools/benchmark_layers.py --batch 8 --radii 2 4 \
        --out-dir work_dirs/benchmarks/layers

The transformer Linears (Segformer-B2 and Swin-T first-stage token grids
and widths at a 512x512 crop, ``BENCHMARK_LINEAR_SHAPES``), one thread,
CPU time of the thread (robust on a shared machine)::

    python tools/benchmark_layers.py --kinds linear --threads 1 \
        --clock thread --out-dir work_dirs/benchmarks/layers_linear

Writes ``layers.json``, ``layers.md`` and ``layers.png`` (speedup per layer)
and prints the table and the medians over layers. CUDA is measured too when
a CUDA GPU is present (``--devices cpu cuda``; ``--device cuda`` for CUDA
alone). On CUDA, cuDNN picks its fastest algorithms for vanilla
(``torch.backends.cudnn.benchmark``, on unless ``--no-cudnn-benchmark``)
and the filtered conv takes the Triton kernels where triton is installed
(``--no-triton``: the step-by-step PyTorch route, for comparison). TF32
follows torch's defaults unless ``--tf32`` / ``--no-tf32`` sets it; the
setting used is recorded in ``layers.json``::

    python tools/benchmark_layers.py --device cuda --dtype bfloat16 \
        --out-dir work_dirs/benchmarks/layers_cuda_bf16
"""
import argparse
import json
import os
import os.path as osp
from typing import List, Optional

import torch

from mmseg_gf.analysis.layer_benchmark import (BENCHMARK_CONV_SHAPES,
                                               BENCHMARK_LINEAR_SHAPES,
                                               CLOCKS, plot, summarize,
                                               time_layer, time_linear_layer,
                                               timing_table)
from mmseg_gf.ops.backend import availability

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16,
          'float16': torch.float16}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--radii', type=int, nargs='+', default=[2, 4])
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument(
        '--layers', type=int, nargs='+', default=None,
        help='indices into the paper\'s Table 10 layers (default: all 7)')
    parser.add_argument(
        '--kinds', nargs='+', choices=['conv', 'linear'], default=['conv'],
        help='conv: the paper\'s 3x3 layers; linear: transformer Linears '
        'on token grids')
    parser.add_argument(
        '--linear-layers', type=int, nargs='+', default=None,
        help='indices into BENCHMARK_LINEAR_SHAPES (default: all '
        f'{len(BENCHMARK_LINEAR_SHAPES)})')
    parser.add_argument(
        '--clock', choices=sorted(CLOCKS), default='wall',
        help='wall: elapsed time; thread: CPU time of the thread (one '
        'CPU thread only)')
    parser.add_argument(
        '--devices', '--device', nargs='+', default=None,
        help='default: cpu, plus cuda when available')
    parser.add_argument(
        '--dtype', choices=sorted(DTYPES), default='float32',
        help='dtype of input, weight and output gradient (both convs)')
    parser.add_argument(
        '--cudnn-benchmark', action=argparse.BooleanOptionalAction,
        default=True, help='torch.backends.cudnn.benchmark (CUDA only)')
    parser.add_argument(
        '--no-triton', action='store_true',
        help='filtered conv on CUDA without the Triton kernels')
    parser.add_argument(
        '--tf32', action=argparse.BooleanOptionalAction, default=None,
        help='CUDA: allow TF32 in cuDNN convolutions and cuBLAS products '
        '(default: torch\'s own defaults)')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch CPU threads (default: torch\'s choice)')
    parser.add_argument(
        '--reuse-cpu-memory', action='store_true',
        help='keep freed CPU memory for reuse (glibc mallopt, as training '
        'with gradient_filter reuse_cpu_memory=True): the backward\'s fresh '
        'outputs then skip the page faults of new memory, for both paths')
    parser.add_argument('--out-dir', default='work_dirs/benchmarks/layers')
    args = parser.parse_args(argv)
    unknown = set(args.devices or ()) - {'cpu', 'cuda'}
    if unknown:
        parser.error(f'--devices: {sorted(unknown)}; allowed: cpu, cuda')
    if 'cuda' in (args.devices or ()) and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA GPU is available to this '
                     f'torch ({torch.__version__})')
    return args


def main(argv: Optional[List[str]] = None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reuse_cpu_memory:
        # engine imports mmseg: only when asked
        from mmseg_gf.engine.cpu_memory import keep_freed_cpu_memory
        if not keep_freed_cpu_memory():
            raise SystemExit('--reuse-cpu-memory: the C library has no '
                             'glibc mallopt')
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if args.no_triton:
        availability.set_triton_enabled(False)
    if args.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    devices = args.devices or (['cpu', 'cuda']
                               if torch.cuda.is_available() else ['cpu'])
    if args.clock == 'thread' and (torch.get_num_threads() != 1
                                   or devices != ['cpu']):
        raise SystemExit('--clock thread times one CPU thread: pass '
                         '--threads 1 and --device cpu')
    layers = [BENCHMARK_CONV_SHAPES[i]
              for i in (args.layers or range(len(BENCHMARK_CONV_SHAPES)))]
    linears = [BENCHMARK_LINEAR_SHAPES[i] for i in (
        args.linear_layers or range(len(BENCHMARK_LINEAR_SHAPES)))]
    rows = []
    for device in devices:
        for cin, cout, h, w in (layers if 'conv' in args.kinds else []):
            print(f'[{device}] {cin}x{cout}@{h}x{w} ...', flush=True)
            rows += time_layer(cin, cout, h, w, args.radii, args.batch,
                               args.repeats, args.warmup, device,
                               DTYPES[args.dtype], args.clock)
        for shape in (linears if 'linear' in args.kinds else []):
            print(f'[{device}] linear {shape.label} ...', flush=True)
            rows += time_linear_layer(shape, args.radii, args.batch,
                                      args.repeats, args.warmup, device,
                                      DTYPES[args.dtype], clock=args.clock)
    os.makedirs(args.out_dir, exist_ok=True)
    table = timing_table(rows)
    summary = {dev: summarize([r for r in rows if r.device.startswith(dev)])
               for dev in devices}
    meta = dict(batch=args.batch, threads=torch.get_num_threads(),
                torch=torch.__version__, repeats=args.repeats,
                dtype=args.dtype, kinds=args.kinds, clock=args.clock,
                reuse_cpu_memory=args.reuse_cpu_memory)
    if 'cuda' in devices:
        meta.update(gpu=torch.cuda.get_device_name(),
                    cudnn_benchmark=args.cudnn_benchmark,
                    triton_kernels=availability.triton_enabled(),
                    tf32=dict(cudnn=torch.backends.cudnn.allow_tf32,
                              matmul=torch.backends.cuda.matmul.allow_tf32))
    with open(osp.join(args.out_dir, 'layers.json'), 'w') as f:
        json.dump(dict(meta=meta, summary=summary,
                       rows=[r.as_dict() for r in rows]), f, indent=2)
    with open(osp.join(args.out_dir, 'layers.md'), 'w') as f:
        f.write(table + '\n')
    plot(rows, osp.join(args.out_dir, 'layers.png'))
    print(table)
    print(json.dumps(dict(meta=meta, summary=summary), indent=2))


if __name__ == '__main__':
    main()
