"""Token layouts the filtered Linear's tests run on (the op's tests and
its compiled and Triton kernels'), and their random tensors."""
import torch

from mmseg_gf.ops import TokenGrid

# (grid, input shape, token_dim): every layout, both token axes, partial
# patches, extra tokens, windows of Swin's 7 x 7.
LAYOUT_CASES = [
    (TokenGrid(4, 6), (2, 24, 5), 1),
    (TokenGrid(5, 7, extra_tokens=2), (2, 37, 5), 1),
    (TokenGrid(5, 3, extra_tokens=1), (16, 3, 5), 0),  # (N, B, C)
    (TokenGrid(3, 5, layout='hwc'), (2, 3, 5, 5), 1),
    (TokenGrid(3, 2, layout='hwc'), (2, 2, 2, 3, 2, 5), 3),  # Twins' LSA
    (TokenGrid.windows(7), (6, 49, 5), 1),
    (TokenGrid(1, 1), (3, 1, 5), 1),
    (TokenGrid(6, 4), (24, 5), 0),  # unbatched
    (TokenGrid(3, 4, trailing_tokens=3), (2, 15, 5), 1),  # Segmenter's head
    (TokenGrid(3, 3, 1, trailing_tokens=2), (12, 2, 5), 0),
]


def linear_inputs(shape, cout=4, seed=0, dtype=torch.float64):
    """Random ``x`` (``shape``), ``W`` (``cout x C``), ``b`` and ``g_y``
    of a Linear on ``shape``'s tokens, seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    w = torch.randn(cout, shape[-1], generator=gen, dtype=dtype)
    b = torch.randn(cout, generator=gen, dtype=dtype)
    g = torch.randn(*shape[:-1], cout, generator=gen, dtype=dtype)
    return x, w, b, g
