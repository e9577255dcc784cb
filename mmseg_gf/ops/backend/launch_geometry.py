"""Launch geometry arithmetic on the host, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``
objects: called from the host they go through a wrapper that unwraps its
arguments (about 2 us a call), and a filtered conv's launches computed
their grids and tiles with 12-14 of them per call. These two give the
same integers for the host's ints (``tests/test_ops/backend/test_launch_geometry.py``
checks them against triton's), at the cost of an integer operation; the
tile choices built on them are cached per shape where they are made
(``shape_caches.lru`` on pure functions of ints, bounded).
"""

__all__ = ['cdiv', 'next_power_of_2']


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints, as ``triton.cdiv``."""
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least ``n`` (0 for ``n <= 0``), as
    ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
