"""Install mmseg_gf: ``pip install -e .`` (see README for the full stack)."""
from setuptools import find_packages, setup

setup(
    name='mmseg_gf',
    version='0.1.0',
    description='Gradient filtering for cheap finetuning in MMSegmentation',
    packages=find_packages(include=['mmseg_gf', 'mmseg_gf.*']),
    python_requires='>=3.8',
    # torch, mmcv (full build) and mmsegmentation are installed by the
    # Makefile in a fixed order: a bare `torch` requirement here would pull
    # a multi-GB CUDA build, and mmcv must be built against torch.
    install_requires=['numpy'],
)
