"""The one table formatter of the plugin's reports.

The training log's cost table, the tools' printed tables, the benchmarks'
``*.md`` files and the pipeline's ``results.md`` all go through
:func:`format_table`, so that a table looks the same wherever it appears and
a change of layout happens in one place. Pure Python (no torch): anything
may import it.
"""
from typing import Optional, Sequence

__all__ = ['format_table']

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
