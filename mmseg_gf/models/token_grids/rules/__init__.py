"""The grid rules of mmseg 1.2.2's transformer blocks, one file per family
(as mmseg's ``models/backbones``): MiT (Segformer), Swin, Twins PCPVT /
SVT, VisionTransformer (DeiT, also under Segmenter, SETR, DPT), BEiT and
MAE, ``SegmenterMaskTransformerHead`` and DPT's readout
(``ReassembleBlocks``).

Importing this package registers them (:mod:`..registry`), in this order;
a new family is one more file registering its rules with
:func:`~..registry.register_grid_rule`, imported here (or, outside the
package, wherever the backbone itself is defined).
"""
from . import mit, swin, twins, vit, beit, segmenter, dpt  # noqa: F401
