"""Time whole training steps of the paper's strategies, side by side.

For one model of the protocol (tools/run_pipeline.py's ``--model``) and a
list of strategies, build each strategy's segmentor exactly as the pipeline
composes it, then time forward (loss), backward and the SGD step on one
random batch at the training crop, median over ``--repeats`` steps after
``--warmup``, all in one process. The last column extrapolates the step time
to the 20k finetuning iterations of the protocol: compute only, without data
loading and validation, which are the same for every strategy.

Example::

    python tools/benchmark_step.py --model pspnet_r18 --crop 512 512 \
        --batch 8 --strategies vanilla_all vanilla_last5 gf_last5_r4
"""
import argparse
import statistics
import time
from typing import Dict, List, Optional

import torch

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)
from mmseg_gf.analysis.model_cost import (build_segmentor, random_batch,
                                          training_loss)
from mmseg_gf.engine.cli import write_json
from mmseg_gf.pipeline import MODELS, compose_config
from mmseg_gf.pipeline.experiments import set_data

FINETUNE_ITERS = 20000


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='pspnet_r18', choices=sorted(MODELS))
    p.add_argument('--dataset', default='voc',
                   help='target dataset of the configs (class count)')
    p.add_argument('--strategies', nargs='+',
                   default=['vanilla_all', 'vanilla_last5', 'gf_last5_r4',
                            'vanilla_last10', 'gf_last10_r4'])
    p.add_argument('--crop', type=int, nargs=2, default=(512, 512),
                   metavar=('H', 'W'))
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--out', help='write the rows as json')
    return p.parse_args(argv)


def time_strategy(model_name: str, dataset: str, strategy: str,
                  crop, batch: int, repeats: int,
                  warmup: int) -> Dict[str, float]:
    """Median forward / backward / optimizer-step seconds of one strategy."""
    cfg = compose_config(model_name, dataset, strategy)
    set_data(cfg, crop=crop)
    model = build_segmentor(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=5e-4)
    inputs, samples = random_batch(model, crop, batch, label_block=16)
    times = {'forward': [], 'backward': [], 'step': []}
    for i in range(warmup + repeats):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = training_loss(model, inputs, samples)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            times['forward'].append(t1 - t0)
            times['backward'].append(t2 - t1)
            times['step'].append(t3 - t0)
    row = {k: statistics.median(v) for k, v in times.items()}
    row.update(strategy=strategy,
               trainable_params=sum(p.numel() for p in params))
    return row


def markdown(rows: List[Dict], reference: Dict) -> str:
    lines = [
        '| strategy | trainable params | forward s | backward s | step s | '
        'backward vs first | step vs first | 20k steps (h) |',
        '|---|---:|---:|---:|---:|---:|---:|---:|'
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['trainable_params'] / 1e6:.2f}M | "
            f"{r['forward']:.3f} | {r['backward']:.3f} | {r['step']:.3f} | "
            f"{reference['backward'] / r['backward']:.1f}x | "
            f"{reference['step'] / r['step']:.2f}x | "
            f"{r['step'] * FINETUNE_ITERS / 3600:.1f} |")
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> List[Dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    crop = tuple(args.crop)
    rows = [
        time_strategy(args.model, args.dataset, s, crop, args.batch,
                      args.repeats, args.warmup) for s in args.strategies
    ]
    print(f'{MODELS[args.model].label}, crop {crop[0]}x{crop[1]}, batch '
          f'{args.batch}, {torch.get_num_threads()} threads, torch '
          f'{torch.__version__}; median of {args.repeats} steps')
    print(markdown(rows, rows[0]))
    if args.out:
        write_json(args.out, dict(model=args.model, crop=crop,
                                  batch=args.batch, rows=rows))
    return rows


if __name__ == '__main__':
    main()
