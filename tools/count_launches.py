"""Kernel launches and bytes moved by one training step on the CUDA path,
counted on a CPU: lean GF rows against vanilla-same-layers.

For each model (mmseg config files, families of mmseg's zoo by name, or
the protocol's models) and row, count one SGD step's launches (forward,
backward, update; per kind of module) and the bytes they move, on CPU
tensors taking the code paths of CUDA tensors, the Triton kernels run by
triton's interpreter; see :mod:`mmseg_gf.accounting.launches` (what counts)
and :mod:`mmseg_gf.analysis.launch_count` (the rows, ratios and tables).
Writes ``launches.json`` and ``launches.md`` to ``--out-dir``.

Examples::

    python tools/count_launches.py --models pspnet_r18 \
        --rows gf_last10_r4:lean vanilla_last10:plain
    python tools/count_launches.py --families bisenetv2 segformer_b0 swin_t \
        --rows gf_last20_r4:lean vanilla_last20:plain --input-size 64
    python tools/count_launches.py my_config.py --offline --batch 2
    # host time outside ATen per step and per kind (torch.profiler)
    python tools/count_launches.py --models pspnet_r18 --host-time \
        --input-size 32 --threads 1 --steps 30
    # on a GPU: the kernels each step launches there, recorded
    python tools/count_launches.py --models pspnet_r18 --device cuda \
        --rows gf_last10_r4:lean vanilla_last10:plain
"""
import os
import sys

# Triton decides at import whether it interprets: set before mmseg_gf is
# imported (the CPU tensors' launches are the interpreter's; on the GPU,
# --device cuda, its kernels compile); run as a script only, never when a
# test loads this file.
_ARGS = ' '.join(sys.argv[1:]).replace('=', ' ').split()
if __name__ == '__main__' and '--no-triton' not in _ARGS and 'cuda' not in [
        b for a, b in zip(_ARGS, _ARGS[1:]) if a == '--device']:
    os.environ['TRITON_INTERPRET'] = '1'

import argparse  # noqa: E402
from typing import List, Optional  # noqa: E402

import torch  # noqa: E402

import mmseg_gf  # noqa: F401,E402  (registers the plugin's modules)
from mmseg_gf.analysis.host_report import run_host_jobs  # noqa: E402
from mmseg_gf.analysis.launch_count import run_jobs  # noqa: E402
from mmseg_gf.analysis.step_benchmark import (parse_row,  # noqa: E402
                                              row_settings, split_compiled)
from mmseg_gf.analysis.step_jobs import (add_model_arguments,  # noqa: E402
                                         check_model_arguments,
                                         config_jobs, family_jobs)
from mmseg_gf.engine.zoo import ZOO_FAMILIES  # noqa: E402
from mmseg_gf.protocol import PROTOCOL_MODELS  # noqa: E402
from mmseg_gf.protocol.experiments import strategy_file  # noqa: E402
from mmseg_gf.protocol.run_config import step_jobs  # noqa: E402

DEFAULT_ROWS = ('gf_last10_r4:lean', 'vanilla_last10:plain')


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_model_arguments(
        p, ZOO_FAMILIES, "families of mmseg's zoo by name "
        '(mmseg_gf/engine/zoo.py), offline', PROTOCOL_MODELS)
    p.add_argument('--rows', nargs='+', default=list(DEFAULT_ROWS),
                   help="training rows: vanilla_last<N>, gf_last<N>_r<R>, "
                   "suffixed :lean (default) or :plain; each lean row is "
                   "compared with vanilla_last<N>:plain when counted too")
    p.add_argument('--input-size', '--crop', dest='crop', type=int,
                   nargs='+', default=[64], metavar='H [W]',
                   help='image size (default 64: the counts hardly depend '
                   "on it, the interpreter's time does; a family runs at "
                   'least at its minimum)')
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--no-triton', dest='triton', action='store_false',
                   help="count CUDA's path without the Triton kernels "
                   '(MMSEG_GF_TRITON=0)')
    p.add_argument('--run-kernels', action='store_true',
                   help="run the Triton kernels in triton's interpreter "
                   '(minutes per step; the default counts their launches '
                   'and zeroes their outputs, the same counts unless a '
                   'value read on the host follows, which is refused)')
    p.add_argument('--device', default='cpu', choices=['cpu', 'cuda'],
                   help="'cuda': run each step on the GPU and record the "
                   'kernels it launches (torch.profiler), the measurement '
                   'the CPU count predicts')
    p.add_argument('--host-time', action='store_true',
                   help='measure the host time outside ATen per step and '
                   'per kind (torch.profiler; mmseg_gf/analysis/'
                   'host_time.py) instead of counting launches; writes '
                   'host_time.json and host_time.md')
    p.add_argument('--steps', type=int, default=20,
                   help='--host-time: profiled steps per row (medians)')
    p.add_argument('--warmup', type=int, default=3,
                   help='--host-time: unprofiled steps first')
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--out-dir', default='work_dirs/benchmarks/launches')
    args = p.parse_args(argv)
    _check_args(p, args)
    args.family_crop = {}
    return args


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Every bad setting is refused before any model is built."""
    check_model_arguments(p, args)
    for row in args.rows:
        try:
            if row_settings(row) is None or parse_row(row)[1] is None:
                raise ValueError(f'row {row!r}: inference and vanilla_all '
                                 'train no gradient-filter setting')
            if split_compiled(row)[1]:
                raise ValueError(f'row {row!r}: launches are counted in '
                                 'eager mode (no compiled rows)')
            for model in args.models:
                strategy_file(row.partition(':')[0], model)
        except ValueError as e:
            p.error(f'--rows: {e}')
    if len(args.crop) == 1:
        args.crop = args.crop * 2
    if len(args.crop) != 2 or min(args.crop) < 1:
        p.error('--input-size: H [W], positive')
    if args.batch < 1:
        p.error('--batch: at least 1')
    if args.steps < 1 or args.warmup < 0:
        p.error('--steps: at least 1; --warmup: at least 0')
    if args.host_time and (args.device != 'cpu' or args.run_kernels):
        p.error('--host-time: measured on the CPU with the Triton launches '
                'stubbed (no --device cuda, no --run-kernels)')
    if args.device == 'cuda' and not torch.cuda.is_available():
        p.error('--device cuda: no CUDA GPU is available to this torch '
                f'({torch.__version__})')
    if args.device == 'cuda' and args.run_kernels:
        p.error('--run-kernels: the interpreter runs on the CPU only; on '
                '--device cuda the kernels run compiled')


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    jobs = config_jobs(args) + family_jobs(args) + step_jobs(
        args.models, args.dataset, args.rows, args.crop, args.cfg_options)
    if args.host_time:
        return run_host_jobs(jobs, args.batch, args.out_dir, args.steps,
                             args.warmup, triton=args.triton)
    return run_jobs(jobs, args.batch, args.out_dir, triton=args.triton,
                    run_kernels=args.run_kernels, device=args.device)


if __name__ == '__main__':
    main()
