"""The compiled CPU kernels' own toggles: oneDNN or MKL for the large
float32 products, AVX-512 for the token-row passes (their state lives in
the extension; :mod:`.switches` declares them and overrides them through
the setters bound here)."""
from . import extension, switches
from .output_pool import applier

__all__ = ['onednn_products_preferred', 'set_onednn_products',
           'token_rows_avx512_enabled', 'set_token_rows_avx512']

_kernels = extension.module('patch_ops')


def onednn_products_preferred() -> bool:
    """Whether this CPU was measured to run the fused backward's large
    float32 products faster as oneDNN convolutions than as MKL GEMMs: AMD
    CPUs with full-width AVX-512 (Zen 5 and later), which MKL does not use
    (see ``csrc/cpu_dispatch.cpp``). The default setting."""
    return _kernels.onednn_products_preferred()


def set_onednn_products(enabled: bool) -> bool:
    """Let large float32 products run on oneDNN (``True``) or always on
    MKL (``False``); returns the previous setting. The filtered Linear's
    CPU backward follows it too: its input-gradient product on oneDNN's
    inner product, its weight-gradient product in its own AVX-512 code
    (``csrc/token_rows_avx512.cpp``, with :func:`set_token_rows_avx512`
    on)."""
    return _kernels.set_onednn_products(bool(enabled))


def token_rows_avx512_enabled() -> bool:
    """Whether the token-grid kernels pool ``g_y`` and spread ``g_x`` of
    float32 rows with AVX-512 (``csrc/token_rows_avx512.cpp``): CPUs with
    AVX-512F, unless switched off."""
    return _kernels.token_rows_avx512_enabled()


def set_token_rows_avx512(enabled: bool) -> bool:
    """Switch the AVX-512 token-row passes off (``False``: the portable
    loops) or back on; returns the previous setting."""
    return _kernels.set_token_rows_avx512(bool(enabled))


switches.bind_applier('onednn_products', applier(set_onednn_products))
switches.bind_applier('token_rows_avx512', applier(set_token_rows_avx512))
