"""mmseg_gf.accounting.format: the one formatter of each kind, against the
figures and layouts written out by hand."""
import pytest

from mmseg_gf.accounting.format import (MIB, fmt_bytes, fmt_flops,
                                        fmt_flops_short, fmt_mib,
                                        format_table)


@pytest.mark.parametrize('value, text', [
    (0, '0B'), (1023, '1023B'), (1536, '1.50KiB'), (3.25 * 2**20, '3.25MiB'),
    (5 * 2**30, '5.00GiB'), (-2048, '-2.00KiB')])
def test_bytes_take_the_largest_binary_unit(value, text):
    assert fmt_bytes(value) == text


def test_mib_with_digits_and_unit_and_blank_for_none():
    assert MIB == 1048576
    assert fmt_mib(3 * MIB // 2) == '1.50'
    assert fmt_mib(3 * MIB // 2, 1, 'MiB') == '1.5MiB'
    assert fmt_mib(None) == ''


@pytest.mark.parametrize('value, long, short', [
    (2.5e9, '2.500G', '2.50G'), (3e6, '3.000M', '3.00M'),
    (1500, '1.500K', '0.00M'), (12, '12', '0.00M')])
def test_flops_long_and_short(value, long, short):
    assert fmt_flops(value) == long
    assert fmt_flops_short(value) == short


def test_markdown_and_text_tables():
    rows = [['conv', 12], ['classifier', 3]]
    assert format_table(['layer', 'MiB'], rows, align='lr') == (
        '| layer | MiB |\n'
        '|---|---:|\n'
        '| conv | 12 |\n'
        '| classifier | 3 |')
    assert format_table(['layer', 'MiB'], rows, align='lr',
                        style='text') == (
        'layer       MiB\n'
        '----------  ---\n'
        'conv         12\n'
        'classifier    3')
    assert format_table(['a'], [['x']], style='text', rule=False) == 'a\nx'


@pytest.mark.parametrize('kwargs, match', [
    (dict(style='html'), 'style must be one of'),
    (dict(align='c'), 'align: one of l/r per column'),
    (dict(rows=[[1, 2, 3]]), 'has 3 cells'),
])
def test_bad_tables_are_refused_naming_the_setting(kwargs, match):
    args = dict(headers=['a', 'b'], rows=[[1, 2]])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        format_table(**args)
