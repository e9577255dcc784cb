"""Plan and run one model x transfer x strategy list, resumably.

Stages, each an ordinary mmengine training run in its own work dir:

1. ``source/`` (only without a source checkpoint): a randomly initialised
   model trained on the source dataset (``strategies/pretrain_source.py``);
2. ``calib/``: calibration on the target dataset from the source model
   (classifier + BN statistics, or the decoder for MobileNetV2);
3. ``<strategy>/seed<S>/``: finetuning from the calibrated model, for every
   strategy and seed.

Every run writes ``run.json`` (its config fingerprint) when it starts and
``result.json`` (validation metrics) when it ends. Running the command again
skips runs whose ``result.json`` matches the current config, resumes runs
that were interrupted (from their last checkpoint) and moves runs made with
a different config (or from a different upstream model) aside to
``<dir>.stale-<n>`` before redoing them. Then ``results.md``,
``results.csv``, ``runs.csv`` and ``results.png`` are (re)written.
"""
import copy
import gc
import hashlib
import json
import os
import os.path as osp
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mmengine.config import Config

from ..datasets import MAKERS
from ..engine.hooks import read_val_metrics
from ..engine.entrypoints import run_in_subprocess, train
from .flops import strategy_cost
from .report import Row, write_report
from .experiments import (CONFIG_DIR, PAPER_STRATEGIES, PROTOCOL_DATASETS,
                          PROTOCOL_MODELS, TRANSFERS, strategy_file,
                          strategy_kind)
from .run_config import adapt_config, compose_config, fill_budget

__all__ = ['ProtocolOptions', 'Stage', 'ProtocolRun', 'prepare_synthetic']

RESULT_FILE = 'result.json'
RUN_FILE = 'run.json'


def _log(msg: str) -> None:
    print(f'[protocol] {msg}', flush=True)


def _fmt_time(sec: float) -> str:
    sec = int(round(sec))
    if sec < 60:
        return f'{sec}s'
    if sec < 3600:
        return f'{sec // 60}m{sec % 60:02d}s'
    return f'{sec // 3600}h{(sec % 3600) // 60:02d}m'


@dataclass
class ProtocolOptions:
    """What tools/run_protocol.py asks for (see its --help).

    Iteration counts left ``None`` keep the configs' values (source 8000,
    calibration 1000 / 5000, finetuning 20000).
    """

    model: str
    transfer: str
    strategies: List[str] = field(
        default_factory=lambda: list(PAPER_STRATEGIES))
    seeds: List[int] = field(default_factory=lambda: [233, 234, 235])
    out_dir: Optional[str] = None
    source_checkpoint: Optional[str] = None
    source_root: Optional[str] = None
    target_root: Optional[str] = None
    synthetic: Optional[str] = None
    synthetic_train: int = 64
    synthetic_val: int = 16
    crop: Optional[Tuple[int, int]] = None
    batch_size: Optional[int] = None
    num_workers: Optional[int] = None
    source_iters: Optional[int] = None
    calib_iters: Optional[int] = None
    finetune_iters: Optional[int] = None
    val_interval: Optional[int] = None
    calib_seed: int = 233
    cfg_options: Dict[str, Any] = field(default_factory=dict)
    isolate: bool = False
    config_dir: str = CONFIG_DIR


@dataclass
class Stage:
    """One training run of the plan."""

    name: str
    kind: str  # 'source' | 'calib' | 'finetune'
    strategy: str
    seed: int
    work_dir: str
    cfg: Optional[Config] = None
    fingerprint: str = ''
    upstream: Optional['Stage'] = None
    status: str = 'todo'  # 'done' | 'partial' | 'todo'

    @property
    def checkpoint(self) -> str:
        """The checkpoint the run ends with."""
        return osp.join(self.work_dir,
                        f'iter_{int(self.cfg.train_cfg.max_iters)}.pth')


def prepare_synthetic(root: str, dataset: str, num_train: int, num_val: int,
                      seed: int = 0) -> Tuple[str, Tuple[int, int]]:
    """Write a synthetic dataset under ``root/<dataset>`` unless it is there
    with the same settings (``synthetic.json``).

    Returns:
        ``(data_root, (H, W))``: the config's data root and image size.
    """
    spec = PROTOCOL_DATASETS[dataset]
    out = osp.join(root, dataset)
    settings = dict(spec.synthetic, num_train=int(num_train),
                    num_val=int(num_val), seed=int(seed))
    settings['size'] = list(settings['size'])
    stamp = osp.join(out, 'synthetic.json')
    same = False
    if osp.isfile(stamp):
        with open(stamp) as f:
            same = json.load(f) == settings
    if not same:
        t = time.time()
        kwargs = dict(settings)
        kwargs['size'] = tuple(kwargs['size'])
        MAKERS[spec.maker](out, **kwargs)
        os.makedirs(out, exist_ok=True)
        with open(stamp, 'w') as f:
            json.dump(settings, f)
        _log(f'synthetic {spec.label} written to {out} ({num_train} train / '
             f'{num_val} val, {time.time() - t:.1f}s)')
    data_root = osp.join(out, spec.subdir) if spec.subdir else out
    return data_root, tuple(spec.synthetic['size'])


def _fingerprint(cfg: Config, upstream: Optional[Stage]) -> str:
    d = cfg.to_dict()
    for key in ('work_dir', 'resume', 'launcher'):
        d.pop(key, None)
    text = json.dumps(d, sort_keys=True, default=str)
    if upstream is not None:
        text += upstream.fingerprint
    return hashlib.sha1(text.encode('utf-8')).hexdigest()[:16]


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    if not osp.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


class ProtocolRun:
    """Plan, run and report one model x transfer experiment.

    Args:
        opts: the options.
    """

    def __init__(self, opts: ProtocolOptions) -> None:
        if opts.model not in PROTOCOL_MODELS:
            raise ValueError(f'unknown model {opts.model!r}; one of '
                             f'{list(PROTOCOL_MODELS)}')
        if opts.transfer not in TRANSFERS:
            raise ValueError(f'unknown transfer {opts.transfer!r}; one of '
                             f'{list(TRANSFERS)}')
        if not opts.seeds:
            raise ValueError('give at least one seed')
        self.opts = opts
        self.source, self.target = TRANSFERS[opts.transfer]
        # Validate the strategies early (a typo must not cost a source run).
        for s in opts.strategies:
            strategy_file(s, opts.model, opts.config_dir)
        self.out_dir = osp.abspath(opts.out_dir or osp.join(
            'work_dirs', 'protocol', f'{opts.model}_{opts.transfer}'))
        self.data: Dict[str, Dict[str, Any]] = {}
        self.stages: List[Stage] = []

    # ------------------------------------------------------------- planning
    def prepare_data(self) -> None:
        """Synthetic data (``--synthetic``) or the given data roots."""
        o = self.opts
        for role, key, root in (('source', self.source, o.source_root),
                                ('target', self.target, o.target_root)):
            info: Dict[str, Any] = dict(dataset=key, data_root=root,
                                        image_size=None)
            if o.synthetic:
                info['data_root'], info['image_size'] = prepare_synthetic(
                    o.synthetic, key, o.synthetic_train, o.synthetic_val)
            self.data[role] = info

    @property
    def crop(self) -> Optional[Tuple[int, int]]:
        if self.opts.crop is not None:
            return tuple(self.opts.crop)
        if self.opts.synthetic:
            return (64, 64)
        return None

    def _config(self, role: str, strategy: str, seed: int, work_dir: str,
                max_iters: Optional[int], val_interval: Optional[int],
                load_from: Optional[str]) -> Config:
        data = self.data[role]
        cfg = compose_config(self.opts.model, data['dataset'], strategy,
                             self.opts.config_dir)
        if strategy == 'pretrain_source':
            # From scratch: the backbone's BN statistics must be learnt.
            cfg.merge_from_dict({'model.backbone.norm_eval': False})
        cfg = adapt_config(
            cfg, work_dir, seed, data_root=data['data_root'],
            image_size=data['image_size'], crop=self.crop,
            max_iters=max_iters, val_interval=val_interval,
            batch_size=self.opts.batch_size,
            num_workers=self.opts.num_workers, load_from=load_from,
            cfg_options=self.opts.cfg_options)
        # at the run's crop: the budget is the compute of another strategy
        return fill_budget(cfg, strategy, self.opts.model,
                           self.opts.config_dir)

    def _source_checkpoint(self) -> Optional[str]:
        ckpt = self.opts.source_checkpoint
        if ckpt == 'zoo':
            zoo = PROTOCOL_MODELS[self.opts.model].zoo
            if self.source not in zoo:
                raise ValueError(
                    f'mmseg publishes no {self.source} checkpoint of '
                    f'{self.opts.model} that this tool knows; give a file '
                    '(see docs/protocol.md) or leave --source-checkpoint out '
                    'to train a source model here')
            return zoo[self.source]
        return ckpt

    def plan(self) -> List[Stage]:
        """Build every stage's config and find what is already done."""
        if not self.data:
            self.prepare_data()
        o = self.opts
        stages: List[Stage] = []
        upstream: Optional[Stage] = None
        source_ckpt = self._source_checkpoint()
        if source_ckpt is None:
            st = Stage('source', 'source', 'pretrain_source', o.calib_seed,
                       osp.join(self.out_dir, 'source'))
            st.cfg = self._config('source', 'pretrain_source', st.seed,
                                  st.work_dir, o.source_iters, None, None)
            stages.append(st)
            upstream = st
            source_ckpt = st.checkpoint
        calib = Stage('calib', 'calib', 'calib', o.calib_seed,
                      osp.join(self.out_dir, 'calib'), upstream=upstream)
        calib.cfg = self._config('target', 'calib', calib.seed,
                                 calib.work_dir, o.calib_iters, None,
                                 source_ckpt)
        stages.append(calib)
        for strategy in o.strategies:
            if strategy_kind(strategy) == 'calib':
                continue  # the calibration row is the calib stage
            name = osp.splitext(osp.basename(strategy))[0]
            for seed in o.seeds:
                st = Stage(f'{name}/seed{seed}', 'finetune', strategy, seed,
                           osp.join(self.out_dir, name, f'seed{seed}'),
                           upstream=calib)
                st.cfg = self._config('target', strategy, seed, st.work_dir,
                                      o.finetune_iters, o.val_interval,
                                      calib.checkpoint)
                stages.append(st)
        for st in stages:
            st.fingerprint = _fingerprint(st.cfg, st.upstream)
            st.status = self._status(st)
        self.stages = stages
        return stages

    def _status(self, st: Stage) -> str:
        result = _read_json(osp.join(st.work_dir, RESULT_FILE))
        run = _read_json(osp.join(st.work_dir, RUN_FILE))
        if result is not None and result.get('fingerprint') == st.fingerprint:
            return 'done'
        if (result is not None or run is not None) and (
                (result or run).get('fingerprint') != st.fingerprint):
            return 'stale'
        if run is not None and osp.isfile(
                osp.join(st.work_dir, 'last_checkpoint')):
            return 'partial'
        return 'todo'

    def _title(self) -> str:
        """'<model>: <source> -> <target>' in the paper's names."""
        return (f'{PROTOCOL_MODELS[self.opts.model].label}: '
                f'{PROTOCOL_DATASETS[self.source].label} -> '
                f'{PROTOCOL_DATASETS[self.target].label}')

    def print_plan(self) -> None:
        _log(f'{self._title()}; output {self.out_dir}')
        for st in self.stages:
            it = int(st.cfg.train_cfg.max_iters)
            extra = ''
            if st.kind == 'calib' or st.kind == 'source':
                extra = f' from {st.cfg.load_from or "random init"}'
            _log(f'  {st.status:<8}{st.name:<28}{it:>7} iters{extra}')

    # -------------------------------------------------------------- running
    def _move_stale(self, st: Stage) -> None:
        n = 1
        while osp.exists(f'{st.work_dir}.stale-{n}'):
            n += 1
        os.rename(st.work_dir, f'{st.work_dir}.stale-{n}')
        _log(f'{st.name}: made with another config; moved to '
             f'{st.work_dir}.stale-{n}')

    def _train(self, st: Stage, resume: bool) -> None:
        cfg = copy.deepcopy(st.cfg)
        os.makedirs(st.work_dir, exist_ok=True)
        config_path = osp.join(st.work_dir, 'config.py')
        cfg.dump(config_path)
        with open(osp.join(st.work_dir, RUN_FILE), 'w') as f:
            json.dump(dict(name=st.name, fingerprint=st.fingerprint,
                           config=config_path), f, indent=1)
        # The dumped file is what runs, as tools/train.py would run it;
        # without yapf (the Runner prints the config and stores it in every
        # checkpoint, and formatting it takes ~1 s each time on a slow CPU).
        # Resuming: from work_dir's last checkpoint, never from load_from.
        kwargs = dict(work_dir=st.work_dir, resume=resume,
                      cfg_options=dict(load_from=None) if resume else None,
                      format_python_code=False)
        if self.opts.isolate:
            _log(f'{st.name}: training in a new process')
            run_in_subprocess(train, config_path, **kwargs)
            return
        runner = train(config_path, **kwargs)
        records = read_val_metrics(st.work_dir)
        if not records or records[-1]['iter'] != runner.iter:
            runner.val()  # interrupted during the final validation
        del runner
        gc.collect()

    def _collect(self, st: Stage, seconds: float) -> Dict[str, Any]:
        records = read_val_metrics(st.work_dir)
        if not records:
            raise RuntimeError(f'{st.name}: training ended without a '
                               f'validation record in {st.work_dir}')
        max_iters = int(st.cfg.train_cfg.max_iters)
        final = records[-1]
        best = max(records, key=lambda r: r.get('mIoU', float('-inf')))
        result = dict(
            name=st.name, kind=st.kind, strategy=st.strategy, seed=st.seed,
            max_iters=max_iters, fingerprint=st.fingerprint,
            final=final, best=best, val=records,
            checkpoint=st.checkpoint, seconds=seconds,
            work_dir=st.work_dir)
        if final['iter'] != max_iters:
            raise RuntimeError(f'{st.name}: last validation at iteration '
                               f'{final["iter"]}, expected {max_iters}')
        with open(osp.join(st.work_dir, RESULT_FILE), 'w') as f:
            json.dump(result, f, indent=1)
        return result

    def run(self) -> List[Stage]:
        """Run every stage that is not done, in order."""
        if not self.stages:
            self.plan()
        self.print_plan()
        todo = [s for s in self.stages if s.status != 'done']
        t0 = time.time()
        durations: Dict[str, List[float]] = {}
        for i, st in enumerate(todo, 1):
            if st.status == 'stale':
                self._move_stale(st)
                st.status = 'todo'
            resume = st.status == 'partial'
            _log(f'[{i}/{len(todo)}] {st.name}: '
                 f'{"resuming" if resume else "starting"} '
                 f'({int(st.cfg.train_cfg.max_iters)} iters) in {st.work_dir}')
            t = time.time()
            self._train(st, resume)
            sec = time.time() - t
            result = self._collect(st, sec)
            st.status = 'done'
            durations.setdefault(st.kind, []).append(sec)
            mean = {k: sum(v) / len(v) for k, v in durations.items()}
            eta = sum(mean.get(s.kind, sec) for s in todo[i:])
            _log(f'[{i}/{len(todo)}] {st.name}: done in {_fmt_time(sec)}, '
                 f'mIoU {result["final"]["mIoU"]:.2f} (best '
                 f'{result["best"]["mIoU"]:.2f}) | elapsed '
                 f'{_fmt_time(time.time() - t0)}, about {_fmt_time(eta)} '
                 f'left')
        return self.stages

    # ------------------------------------------------------------ reporting
    def costs(self) -> Dict[str, Dict[str, Any]]:
        """#Layers / r / GFLOPs of every strategy (cached per fingerprint
        in ``<strategy>/cost.json``)."""
        out: Dict[str, Dict[str, Any]] = {}
        for st in self.stages:
            if st.kind == 'source' or st.strategy in out:
                continue
            cache = osp.join(osp.dirname(st.work_dir) if st.kind ==
                             'finetune' else st.work_dir, 'cost.json')
            cost = _read_json(cache)
            key = _fingerprint(st.cfg, None)
            if cost is None or cost.get('key') != key:
                cost = strategy_cost(st.cfg, st.kind)
                cost['key'] = key
                os.makedirs(osp.dirname(cache), exist_ok=True)
                with open(cache, 'w') as f:
                    json.dump(cost, f, indent=1)
            out[st.strategy] = cost
        return out

    def report(self) -> Dict[str, str]:
        """Write results.md / .csv / runs.csv / .png from finished runs."""
        if not self.stages:
            self.plan()
        costs = self.costs()
        rows: List[Row] = []
        order: List[str] = []
        for st in self.stages:
            if st.kind != 'source' and st.strategy not in order:
                order.append(st.strategy)
        for strategy in order:
            results = []
            for st in self.stages:
                if st.strategy != strategy:
                    continue
                res = _read_json(osp.join(st.work_dir, RESULT_FILE))
                if res is not None and res.get('fingerprint') == \
                        st.fingerprint:
                    results.append(res)
            rows.append(Row(osp.splitext(osp.basename(strategy))[0],
                            costs[strategy], results))
        o = self.opts
        calib = next(s for s in self.stages if s.kind == 'calib')
        ft = next((s for s in self.stages if s.kind == 'finetune'), None)
        crop = tuple(calib.cfg.model.data_preprocessor['size'])
        title = self._title()
        notes = [
            f'- source model: {calib.cfg.load_from}',
            f'- calibration: {int(calib.cfg.train_cfg.max_iters)} iterations'
            f' (seed {calib.seed}); finetuning: '
            + (f'{int(ft.cfg.train_cfg.max_iters)} iterations, validation '
               f'every {int(ft.cfg.train_cfg.val_interval)}'
               if ft is not None else 'none'),
            f'- batch {int(calib.cfg.train_dataloader.batch_size)}, crop '
            f'{crop[0]}x{crop[1]}, seeds {" ".join(map(str, o.seeds))}',
            '- GFLOPs: backward of the trained convs per image at the crop '
            'size (classifier not counted), from mmseg_gf.protocol.flops',
            '- mIoU / mAcc: final iteration; best mIoU: best validation '
            '(mAcc of that validation); mean [sample std] over seeds',
        ]
        if o.synthetic:
            notes.append(f'- synthetic data under {osp.abspath(o.synthetic)}')
        os.makedirs(self.out_dir, exist_ok=True)
        written = write_report(self.out_dir, title, notes, rows)
        for path in written.values():
            _log(f'wrote {path}')
        return written
