"""Host time of training steps, lean GF against vanilla-same-layers, on
the path CUDA tensors take, measured on a CPU.

What the host spends outside ATen operators (Python, autograd, module
calls) bounds a GPU step once kernels are short. Measured with
torch.profiler on CPU tensors taking CUDA's code paths, Triton launches
stubbed: wall time less the outermost ``aten::`` events, as the sum of
per-piece medians so that a preemption does not inflate the figure; per
kind, with a profiler scope per module call. The method in full:
docs/benchmarks/host_time_cpu_32_b1.md; the tables: :mod:`.host_report`.
"""
import contextlib
import statistics
from collections import defaultdict
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from ..accounting.batch import random_batch, summed_losses
from ..accounting.launches import kernel_outputs, module_kind
from ..models import call_plans
from ..models.segmentor import set_frozen_norms_eval
from ..ops.backend import availability, dispatch, switches
from ..ops.backend.device_path import as_on_cuda
from ..patching import Hooks, plain_class
from .launch_count import build_uninterpreted
from .step_benchmark import lean_against_vanilla, parse_row
from .step_jobs import Job

__all__ = ['TARGETS', 'stubbed_triton', 'host_path', 'training_step',
           'host_times', 'host_time_model', 'compare']

#: Lean over vanilla-same-layers, at most: the step's host time (ratio);
#: a lean layer's host time per call over its plain module's (us).
TARGETS = dict(step=1.2, layer_us=25.0)

_STEP = 'host_time::step'
_PHASE = 'host_time::phase::'
_SCOPE = 'host_time::kind::'
_BACKWARD_FUNCTION = 1  # at::RecordScope::BACKWARD_FUNCTION
_ENGINE = 'autograd::engine::evaluate_function'
#: A lean kind's plain counterpart in the vanilla row.
_PLAIN = {'filtered_conv': 'conv', 'filtered_linear': 'linear'}
_BY_CLASS = ('norm', 'activation', 'dropout', 'pool')


@contextlib.contextmanager
def stubbed_triton() -> Iterator[None]:
    """Triton launches under the interpreter zero their outputs instead of
    running."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no triton: nothing launches one
        yield
        return
    interpreted = InterpretedFunction.run

    def launch(self, *args, grid, warmup, **kwargs):
        if warmup:
            return
        named = dict(zip(self.arg_names, args), **kwargs)
        for name in kernel_outputs(self.fn):
            named[name].zero_()

    InterpretedFunction.run = launch
    try:
        yield
    finally:
        InterpretedFunction.run = interpreted


@contextlib.contextmanager
def host_path(triton: bool = True) -> Iterator[None]:
    """CPU tensors take CUDA tensors' code paths, without ``cuda_path``'s
    dropout mode.

    That ``TorchFunctionMode`` sees every torch call: host time a GPU step
    does not spend.

    Raises:
        RuntimeError: ``triton=True`` without triton's interpreter.
    """
    if triton and not (availability.triton_installed()
                       and switches.value('TRITON_INTERPRET')):
        raise RuntimeError(
            'the host time of the Triton path on a CPU needs triton '
            'installed and TRITON_INTERPRET=1 in the environment before '
            'mmseg_gf is imported; or measure without it (triton=False)')
    with availability.triton_switched(triton), \
            switches.override(MMSEG_GF_NATIVE=False), as_on_cuda(), \
            stubbed_triton():
        yield


def _kind(module: nn.Module) -> Optional[str]:
    """The key a module's calls go to (see the module docstring)."""
    kind = module_kind(module)
    if kind is None:
        plain = plain_class(module)
        if plain.__name__ == 'ConvModule' and getattr(
                module, 'with_norm', False) and getattr(
                    module, 'with_activation', False):
            return 'conv_block'
        return None
    if kind in _BY_CLASS:
        return f'{kind}:{plain_class(module).__name__}'
    return kind


class _Ranges:
    """Each scoped call's autograd sequence numbers, to attribute backward
    nodes."""

    def __init__(self) -> None:
        self.stack: List[Tuple[str, int]] = []
        self.ranges: List[Tuple[int, int, int, str]] = []

    def enter(self, kind: str) -> None:
        self.stack.append((kind, torch._C._autograd._get_sequence_nr()))

    def exit(self) -> None:
        kind, start = self.stack.pop()
        end = torch._C._autograd._get_sequence_nr()
        if end > start:
            self.ranges.append((start, end, len(self.stack), kind))

    def by_sequence(self) -> Dict[int, Tuple[str, ...]]:
        out: Dict[int, Tuple[str, ...]] = {}
        for start, end, _, kind in sorted(self.ranges, key=lambda r: r[2]):
            for seq in range(start, end):
                out[seq] = out.get(seq, ()) + (kind, )
        return out


@contextlib.contextmanager
def _scoped(model: nn.Module, ranges: _Ranges) -> Iterator[None]:
    """Every call of a kind's module is a profiler scope and a sequence
    range."""
    kinds = {id(m): k for m in model.modules() for k in [_kind(m)] if k}
    open_scopes: List[record_function] = []

    def pre(module, args):
        kind = kinds.get(id(module))
        if kind is not None:
            ranges.enter(kind)
            scope = record_function(_SCOPE + kind)
            scope.__enter__()
            open_scopes.append(scope)

    def post(module, args, output):
        if id(module) in kinds:
            open_scopes.pop().__exit__(None, None, None)
            ranges.exit()

    hooks = Hooks([nn.modules.module.register_module_forward_pre_hook(pre),
                   nn.modules.module.register_module_forward_hook(post)])
    with hooks.removed_after():
        yield


#: One timed piece of a step: its event's name, phase, kinds (outermost
#: first), whether it is ATen time, and its microseconds.
_Piece = Tuple[str, str, Tuple[str, ...], bool, float]


def _pieces(root, by_seq: Dict[int, Tuple[str, ...]]) -> List[_Piece]:
    """One step's profile as pieces: outermost ATen events and the gaps
    between."""
    out: List[_Piece] = []

    def chain_of(event, chain):
        name = event.name
        if name.startswith(_SCOPE):
            kind = name[len(_SCOPE):]
            return chain + (kind, ) if kind not in chain else chain
        if event.scope == _BACKWARD_FUNCTION and event.sequence_nr >= 0:
            return by_seq.get(event.sequence_nr, ())
        if name.startswith(_ENGINE):
            for child in event.cpu_children:
                if child.scope == _BACKWARD_FUNCTION:
                    return by_seq.get(child.sequence_nr, ())
        return chain

    def walk(event, chain, phase):
        chain = chain_of(event, chain)
        if event.name.startswith('aten::'):
            out.append((event.name, phase, chain, True,
                        event.cpu_time_total))
            return
        # the gaps between the children, each a piece of its own
        start = event.time_range.start
        for i, child in enumerate(event.cpu_children + [None]):
            end = event.time_range.end if child is None else \
                child.time_range.start
            out.append((f'{event.name}#{i}', phase, chain, False,
                        max(0.0, end - start)))
            if child is not None:
                phase_of = (child.name[len(_PHASE):]
                            if child.name.startswith(_PHASE) else phase)
                walk(child, chain, phase_of)
                start = child.time_range.end

    walk(root, (), '')
    return out


def _medians(steps: List[List[_Piece]]) -> Tuple[List[_Piece], int]:
    """Each piece's median over the steps shaped like the most common one, and
    their count."""
    shapes = [tuple(p[0] for p in pieces) for pieces in steps]
    common = statistics.mode(shapes)
    chosen = [pieces for pieces, shape in zip(steps, shapes)
              if shape == common]
    merged = [(name, phase, chain, aten,
               _median([pieces[i][4] for pieces in chosen]))
              for i, (name, phase, chain, aten, _) in enumerate(chosen[0])]
    return merged, len(chosen)


def _totals(pieces: Sequence[_Piece]) -> Dict:
    """The step's, each phase's and each kind's ATen and host time (us)."""
    def blank():
        return dict(wall_us=0.0, aten_us=0.0, host_us=0.0)

    step, phases = blank(), defaultdict(blank)
    kinds: Dict[str, Dict[str, float]] = defaultdict(
        lambda: dict(calls=0, host_us=0.0, aten_us=0.0))
    for name, phase, chain, aten, us in pieces:
        key = 'aten_us' if aten else 'host_us'
        for total in (step, phases[phase]) if phase else (step, ):
            total[key] += us
            total['wall_us'] += us
        for kind in chain:
            kinds[kind][key] += us
        if name.startswith(_SCOPE) and name.endswith('#0'):
            kinds[name[len(_SCOPE):-2]]['calls'] += 1
    return dict(step=step, phases=dict(phases), kinds=dict(kinds))


def _phases() -> Callable[[str], None]:
    """``phase(name)`` closes the open phase scope and opens ``name``'s."""
    current: List[record_function] = []

    def phase(name: str) -> None:
        if current:
            current.pop().__exit__(None, None, None)
        if name:
            current.append(record_function(_PHASE + name))
            current[-1].__enter__()
    return phase


def _profiled(steps_of: Sequence[Callable], steps: int,
              by_seq: Callable[[], Dict]) -> List[Tuple[List[_Piece], int]]:
    """``steps`` profiled runs of each step function, in turn; per function its
    medians."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            for i, step in enumerate(steps_of):
                with record_function(f'{_STEP}{i}'):
                    phase = _phases()
                    phase('forward')
                    step(phase)
                    phase('')
    seq = by_seq()
    pieces: List[List[List[_Piece]]] = [[] for _ in steps_of]
    for event in prof.events():
        if event.name.startswith(_STEP) and event.cpu_parent is None:
            pieces[int(event.name[len(_STEP):])].append(_pieces(event, seq))
    return [_medians(p) for p in pieces]


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _summarised(plain: Tuple[List[_Piece], int],
                scoped: Tuple[List[_Piece], int]) -> Dict:
    """The step and phases from the plain runs, the kinds from the scoped
    runs."""
    bare, kinds = _totals(plain[0]), _totals(scoped[0])
    return dict(step=bare['step'], phases=bare['phases'],
                kinds=kinds['kinds'], steps_used=[plain[1], scoped[1]])


def training_step(cfg, crop: Sequence[int], batch: int = 1
                  ) -> Tuple[nn.Module, Callable]:
    """``cfg``'s segmentor and its SGD training step ``step(phase)`` on a
    random batch."""
    torch.manual_seed(0)
    model = build_uninterpreted(cfg)
    inputs, samples = random_batch(model, crop, batch, label_block=16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=5e-4,
                          foreach=True)
    model.train()
    set_frozen_norms_eval(model)

    def step(phase) -> None:
        loss = summed_losses(model.loss(inputs, samples))
        phase('backward')
        loss.backward()
        phase('optimizer')
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def host_times(cfgs: Sequence, crop: Sequence[int], batch: int = 1,
               steps: int = 20, warmup: int = 3,
               triton: bool = True) -> List[Dict]:
    """Each config's host time per step and per kind, rows taken in turn;
    ``decided``: the dispatcher's misses and the call plans made in the
    plain profiled steps of all rows (none once the warm-up has run)."""
    built = [training_step(cfg, crop, batch) for cfg in cfgs]
    steps_of = [step for _, step in built]
    with host_path(triton):
        for _ in range(warmup):
            for step in steps_of:
                step(lambda name: None)
        decided = _decisions()
        plain = _profiled(steps_of, steps, dict)
        decided = {k: v - decided[k] for k, v in _decisions().items()}
        ranges = _Ranges()
        with contextlib.ExitStack() as stack:
            for model, _ in built:
                stack.enter_context(_scoped(model, ranges))
            scoped = _profiled(steps_of, steps, ranges.by_sequence)
    return [dict(_summarised(p, s), decided=decided)
            for p, s in zip(plain, scoped)]


def _decisions() -> Dict[str, int]:
    """What the process decided so far: dispatcher choices made without
    its cache, filtered layers' call plans."""
    return dict(dispatch_misses=dispatch.misses(),
                plans_made=call_plans.plans_made())


def compare(rows: Sequence[Dict]) -> List[Dict]:
    """Each lean row against its vanilla-same-layers row, against
    :data:`TARGETS`."""
    out = []
    for r, ref in lean_against_vanilla(rows):
        ratio = r['step']['host_us'] / max(ref['step']['host_us'], 1e-9)
        layers = []
        for kind, v in sorted(r['kinds'].items()):
            base = ref['kinds'].get(_PLAIN.get(kind, kind))
            if not v['calls'] or not base or not base['calls']:
                continue
            lean_us = v['host_us'] / v['calls']
            plain_us = base['host_us'] / base['calls']
            layers.append(dict(kind=kind, calls=v['calls'],
                               lean_us=lean_us, vanilla_us=plain_us,
                               overhead_us=lean_us - plain_us,
                               met=lean_us - plain_us <= TARGETS['layer_us']))
        out.append(dict(lean=r['row'], vanilla=ref['row'], ratio=ratio,
                        met=ratio <= TARGETS['step'], layers=layers))
    return out


def host_time_model(job: Job, batch: int = 1, steps: int = 20,
                    warmup: int = 3, triton: bool = True,
                    progress=None) -> Dict:
    """Every row of one model measured and compared (:func:`compare`)."""
    name, label, crop, rows = job
    say = progress or (lambda message: None)
    parsed = []
    for row, _ in rows:
        strategy, lean = parse_row(row)
        if lean is None:
            raise ValueError(f'row {row!r}: the host time needs a training '
                             'row (a gradient-filter setting)')
        parsed.append(dict(row=row, strategy=strategy, lean=lean))
    say(f"[{name}] host time of {', '.join(r for r, _ in rows)}")
    measured = [dict(p, **t) for p, t in zip(parsed, host_times(
        [cfg for _, cfg in rows], crop, batch, steps, warmup, triton))]
    return dict(model=name, label=label, crop=list(crop), batch=int(batch),
                steps=int(steps), threads=torch.get_num_threads(),
                torch=torch.__version__, rows=measured,
                comparisons=compare(measured))
