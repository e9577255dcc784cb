"""How the plugin writes numbers and tables: one formatter of each kind.

The training log's cost table, the tools' printed tables, the benchmarks'
``*.md`` files and the protocol's ``results.md`` all go through
:func:`format_table`, and bytes and FLOPs through :func:`fmt_bytes`,
:func:`fmt_mib` and :func:`fmt_flops`, so that a figure looks the same
wherever it appears and a change of layout happens in one place. Pure
Python (no torch): anything may import it.
"""
from typing import Optional, Sequence

__all__ = ['MIB', 'format_table', 'fmt_bytes', 'fmt_mib', 'fmt_flops',
           'fmt_flops_short']

#: Bytes in a MiB: every figure in MiB divides by this.
MIB = 2**20


def fmt_bytes(v: float) -> str:
    """Bytes in GiB/MiB/KiB with two decimals (``'3.25MiB'``)."""
    for unit, scale in (('GiB', 2**30), ('MiB', MIB), ('KiB', 2**10)):
        if abs(v) >= scale:
            return f'{v / scale:.2f}{unit}'
    return f'{v:.0f}B'


def fmt_mib(v: Optional[float], digits: int = 2, unit: str = '') -> str:
    """Bytes as MiB with ``digits`` decimals, ``unit`` appended (the
    training log writes ``'1.50MiB'``, tables ``'1.5'`` under a MiB
    header); ``''`` for None (not measured)."""
    return '' if v is None else f'{v / MIB:.{digits}f}{unit}'


def fmt_flops(v: float) -> str:
    """FLOPs with a G/M/K prefix and three decimals (the tools' tables)."""
    for unit, scale in (('G', 1e9), ('M', 1e6), ('K', 1e3)):
        if abs(v) >= scale:
            return f'{v / scale:.3f}{unit}'
    return f'{v:.0f}'


def fmt_flops_short(v: float) -> str:
    """The training log's short form: G above 1e9, else M."""
    if v >= 1e9:
        return f'{v / 1e9:.2f}G'
    return f'{v / 1e6:.2f}M'

STYLES = ('markdown', 'text')


def format_table(headers: Sequence[object],
                 rows: Sequence[Sequence[object]],
                 align: Optional[str] = None,
                 style: str = 'markdown',
                 rule: bool = True) -> str:
    """Lay out ``rows`` under ``headers`` (cells printed with ``str``).

    Args:
        headers: the column titles.
        rows: the cells, one sequence per row, as many as ``headers``.
        align: one letter per column, ``'l'`` (left) or ``'r'`` (right);
            default: every column left. Markdown writes it into the rule
            line (``---`` / ``---:``) for the renderer; text pads with it.
        style: ``'markdown'`` (``| a | b |`` rows, for ``.md`` files and
            output pasted into them) or ``'text'`` (columns padded to their
            widest cell and separated by two spaces, for terminals and
            logs, where markdown's bars are noise).
        rule: text style: a line of dashes under the headers.

    Returns:
        The table, lines joined by ``\\n``, without a final newline.
    """
    if style not in STYLES:
        raise ValueError(f'style must be one of {STYLES}, got {style!r}')
    align = align or 'l' * len(headers)
    if len(align) != len(headers) or set(align) - {'l', 'r'}:
        raise ValueError(f'align: one of l/r per column ({len(headers)}), '
                         f'got {align!r}')
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    for r in cells:
        if len(r) != len(headers):
            raise ValueError(f'row {r} has {len(r)} cells, the table '
                             f'{len(headers)} columns')
    if style == 'markdown':
        bars = ['---:' if a == 'r' else '---' for a in align]
        lines = ['| ' + ' | '.join(r) + ' |' for r in cells]
        lines.insert(1, '|' + '|'.join(bars) + '|')
        return '\n'.join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return '  '.join(c.rjust(w) if a == 'r' else c.ljust(w)
                         for c, w, a in zip(r, widths, align))

    lines = [line(r) for r in cells]
    if rule:
        lines.insert(1, line(['-' * w for w in widths]))
    return '\n'.join(lines)
