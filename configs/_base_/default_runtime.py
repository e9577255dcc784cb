# mmseg's runtime (default_scope='mmseg', logging, visualizer, TTA model)
# plus the plugin import, so every config here registers mmseg_gf's modules
# and hooks even when run with mmseg's own tools/train.py.
_base_ = ['mmseg::_base_/default_runtime.py']
custom_imports = dict(imports=['mmseg_gf'], allow_failed_imports=False)
randomness = dict(seed=233)
