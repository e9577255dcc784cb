"""Every environment variable and runtime toggle of mmseg_gf, declared once.

docs/switches.md is :func:`markdown`'s table (a test keeps them equal and
every ``MMSEG_GF_*`` name in the sources declared) and explains the rules:
the environment is read once; :func:`set_value` wins over it;
:func:`override` stands in for it inside a block, reaching switches held
in compiled code through :func:`bind_applier`. Switches read elsewhere
(``setup.py``, glibc) are declared for the list's sake and refused by
:func:`value`. Imports nothing of mmseg_gf or torch.
"""
import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

__all__ = ['Switch', 'SWITCHES', 'value', 'values', 'set_value', 'override',
           'reread', 'bind_applier', 'markdown']

#: ``reader`` of a switch whose value :func:`value` gives.
PYTHON = 'mmseg_gf'


def on_unless_zero(text: str) -> bool:
    """On for any value but ``0`` (an unset variable takes the default)."""
    return text != '0'


def truthy(text: str) -> bool:
    """On for ``1``, ``true``, ``on`` or ``yes``, as ``TRITON_INTERPRET``."""
    return text.lower() in ('1', 'true', 'on', 'yes')


def cost_factor(text: str) -> float:
    """A number >= 1; anything else is refused with the variable's name."""
    try:
        factor = float(text)
    except ValueError:
        factor = 0.0
    if not factor >= 1:
        raise ValueError('MMSEG_GF_CHECKPOINT_COST_FACTOR must be a number '
                         f'>= 1 (times the file size), got {text!r}')
    return factor


@dataclass(frozen=True)
class Switch:
    """One switch: ``name`` (environment variable, or a lower-case toggle
    name), ``parse`` (text to value), ``reader`` (:data:`PYTHON`:
    :func:`value`) and ``setter`` (what changes it in a running process).
    """
    name: str
    default: Any
    kind: type
    doc: str
    parse: Optional[Callable[[str], Any]] = None
    reader: str = PYTHON
    setter: str = ''

    @property
    def from_environment(self) -> bool:
        return self.name.isupper()


SWITCHES: Dict[str, Switch] = {s.name: s for s in (
    Switch('MMSEG_GF_NATIVE', True, bool,
           'The compiled CPU kernels (`0`: the PyTorch path everywhere, the '
           'same numbers).', on_unless_zero),
    Switch('MMSEG_GF_TRITON', True, bool,
           'The Triton GPU kernels (`0`: CUDA tensors take the PyTorch '
           'path).', on_unless_zero,
           setter='mmseg_gf.ops.backend.availability.set_triton_enabled'),
    Switch('MMSEG_GF_FUSED_PRODUCTS', True, bool,
           "A filtered layer's patch-grid products on the Triton path as "
           'one fused launch (`0`: batched GEMMs, a tap sum and a spread; '
           'ops/conv/products_kernels.py says why).',
           on_unless_zero),
    Switch('MMSEG_GF_AUTOTUNE', True, bool,
           "The fused products' tiles on a GPU chosen by `triton.autotune` "
           'once per layer shape (`0`: fixed tiles from the shape; '
           'ops/conv/products_kernels.py says which).', on_unless_zero),
    Switch('MMSEG_GF_CONV_BLOCKS', True, bool,
           "mmcv ConvModules of a filtered conv, a frozen batch norm and a "
           'bit-masked activation as one node on the Triton path (`0`: '
           'their three modules; models/conv_block.py says when).',
           on_unless_zero),
    Switch('MMSEG_GF_RESIZE_GEMM', True, bool,
           'Bilinear resizes of the lean loss and heads on CUDA as two '
           "matrix products (`0`: torch's resize kernels; ops/"
           'resize/gemm.py says why).', on_unless_zero),
    Switch('TRITON_INTERPRET', False, bool,
           "Triton's own interpreter switch (triton reads it too); read "
           'when `mmseg_gf` is imported, it lets CPU tensors take the '
           "Triton path (the kernels' tests, launch counts).", truthy),
    Switch('MMSEG_GF_RECYCLE_MB', 256, int,
           'MiB of freed large CPU outputs the compiled kernels keep for '
           'reuse (`0`: none; a `process_mib` budget on CPU sets 0).', int,
           reader='C++ (ops/csrc/output_recycler.cpp)',
           setter='mmseg_gf.ops.backend.output_pool.recycle_limit'),
    Switch('MMSEG_GF_CHECKPOINT_COST_FACTOR', 4.0, float,
           'What a checkpoint file may declare, times its size, before '
           'the loader refuses it.', cost_factor,
           setter='mmseg_gf.engine.checkpoint.load_bounds.set_load_limit'),
    Switch('checkpoint_floor_bytes', 64 << 20, int,
           'What any checkpoint may declare, whatever its size.',
           setter='mmseg_gf.engine.checkpoint.load_bounds.set_load_limit'),
    Switch('MMSEG_GF_BUILD_NATIVE', True, bool,
           'Build the compiled CPU kernels at install (`0`: skip them; '
           'setup.py reads it itself). Read at import too: `0` there '
           'silences the warning that the kernels are missing.',
           on_unless_zero),
    Switch('MMSEG_GF_UNITY_BUILD', True, bool,
           "Compile `_patch_ops` as one translation unit (`0`: its files "
           'one by one).', on_unless_zero, reader='setup.py'),
    Switch('MMSEG_GF_FUZZ_SEED', 20261126, int,
           "The seed of the checkpoint loader's fuzz test.", int),
    Switch('onednn_products', None, bool,
           "Large float32 products of the fused CPU backward on oneDNN; "
           'default: on for AMD CPUs with full-width AVX-512.',
           reader='C++', setter='mmseg_gf.ops.backend.cpu_settings.set_onednn_products'),
    Switch('token_rows_avx512', None, bool,
           'AVX-512 pooling and spread of token rows; default: on where '
           'the CPU has AVX-512F.', reader='C++',
           setter='mmseg_gf.ops.backend.cpu_settings.set_token_rows_avx512'),
    Switch('keep_freed_cpu_memory', False, bool,
           "malloc keeps freed memory for reuse (the `reuse_cpu_memory` "
           'setting).', reader='glibc',
           setter='mmseg_gf.engine.cpu_memory.keep_freed_cpu_memory'),
    Switch('kept_sources_recording', False, bool,
           'Lean losses record which logits each kept gradient came from '
           '(the step tracer).', reader='mmseg_gf.ops.lean.kept_sources',
           setter='mmseg_gf.ops.lean.kept_sources.recording'),
    Switch('as_on_cuda', False, bool,
           "CPU tensors take CUDA's side of the host checks (launch "
           'counting).', reader='mmseg_gf.ops.backend.device_path',
           setter='mmseg_gf.ops.backend.device_path.as_on_cuda'),
)}

_UNREAD = object()
_environment: Dict[str, Any] = {}  # name -> the environment's value
_runtime: Dict[str, Any] = {}  # name -> the value set_value gave
#: name -> apply(value) -> restore, for switches read outside Python
_appliers: Dict[str, Callable[[Any], Callable[[], None]]] = {}
#: names -> their values, as :func:`values` last gave them; emptied by every
#: change (:func:`set_value`, :func:`override`, :func:`reread`)
_snapshots: Dict[Tuple[str, ...], Tuple[Any, ...]] = {}


def _declared(name: str) -> Switch:
    switch = SWITCHES.get(name)
    if switch is None:
        raise KeyError(f'no switch {name!r}; declared: {sorted(SWITCHES)}')
    if switch.reader != PYTHON:
        raise KeyError(f'{name} is read by {switch.reader}, not through '
                       'switches' + (f'; change it with {switch.setter}'
                                     if switch.setter else ''))
    return switch


def _checked(switch: Switch, given: Any) -> Any:
    """``given`` if of the switch's type, so that ``override(X='0')`` cannot
    pass for off.
    """
    kinds = (int, float) if switch.kind is float else (switch.kind, )
    if isinstance(given, bool) and switch.kind is not bool or \
            not isinstance(given, kinds):
        raise TypeError(f'{switch.name} takes a {switch.kind.__name__}, '
                        f'got {given!r}')
    return given


def _read(switch: Switch) -> Any:
    if not switch.from_environment:
        return switch.default
    text = os.environ.get(switch.name)
    return switch.default if not text else switch.parse(text)


def value(name: str) -> Any:
    """The switch's value: set at run time, else the environment's, else its
    default.

    Read at import, not at the first call, so that ``torch.compile`` can trace
    this function without a graph break. A variable that does not parse raises
    ValueError naming it.
    """
    found = _runtime.get(name, _UNREAD)
    if found is not _UNREAD:
        return found
    found = _environment.get(name, _UNREAD)
    if found is _UNREAD:
        found = _environment[name] = _read(_declared(name))
    return found


def values(names: Tuple[str, ...]) -> Tuple[Any, ...]:
    """:func:`value` of each of ``names``, read once and kept until a switch
    changes: what a per-call cache key holds (one dict lookup a call)."""
    found = _snapshots.get(names)
    if found is None:
        found = _snapshots[names] = tuple(value(name) for name in names)
    return found


def set_value(name: str, new: Any) -> Any:
    """Set the switch for this process (None: back to the environment); returns
    the previous run-time value.
    """
    switch = _declared(name)
    if new is not None:
        new = _checked(switch, new)
    previous = _runtime.pop(name, None)
    if new is not None:
        _runtime[name] = new
    _snapshots.clear()
    return previous


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Inside the block each named switch reads as if the environment gave
    it the value; switches held outside Python are set through their owners'
    :func:`bind_applier` and restored afterwards.
    """
    values = {name: _checked(_overridable(name), given)
              for name, given in values.items()}
    applied = {n: v for n, v in values.items() if n in _appliers}
    read = {n: v for n, v in values.items() if n not in applied}
    saved = {name: _environment.get(name, _UNREAD) for name in read}
    restores = []
    try:
        for name, given in applied.items():
            restores.append(_appliers[name](given))
        _environment.update(read)
        _snapshots.clear()
        yield
    finally:
        for restore in reversed(restores):
            restore()
        for name, old in saved.items():
            if old is _UNREAD:
                _environment.pop(name, None)
            else:
                _environment[name] = old
        _snapshots.clear()


def bind_applier(name: str,
                 apply: Callable[[Any], Callable[[], None]]) -> None:
    """Let :func:`override` reach a switch held outside Python:
    ``apply(value)`` sets it and returns what restores the previous state.
    """
    switch = SWITCHES.get(name)
    if switch is None or switch.reader == PYTHON:
        raise KeyError(f'{name!r} is no switch read outside Python')
    _appliers[name] = apply


def _overridable(name: str) -> Switch:
    """The switch, if :func:`override` can reach it."""
    switch = SWITCHES.get(name)
    if switch is not None and name in _appliers:
        return switch
    return _declared(name)


def reread(*names: str) -> None:
    """Read the environment again for ``names`` (all when none); a value
    that does not parse is left for :func:`value` to refuse.
    """
    for name in names or [s.name for s in SWITCHES.values()
                          if s.reader == PYTHON]:
        _environment.pop(name, None)
        try:
            _environment[name] = _read(_declared(name))
        except ValueError:
            pass
    _snapshots.clear()


def markdown() -> str:
    """The list as a markdown table, docs/switches.md's."""
    rows = ['| Name | Default | Type | Read by | Changed at run time by '
            '| What it does |', '|---|---|---|---|---|---|']
    for s in SWITCHES.values():
        default = 'per CPU' if s.default is None else f'`{s.default}`'
        setter = f'`{s.setter}`' if s.setter else ''
        rows.append(f'| `{s.name}` | {default} | {s.kind.__name__} | '
                    f'{s.reader} | {setter} | {s.doc} |')
    return '\n'.join(rows) + '\n'


reread()
