"""Token layouts the filtered Linear's tests run on (the op's tests and
its compiled kernel's)."""
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
