"""Megatron-Core (0.16 through 0.19) where transformer-engine is not installed, on any device.

Megatron imports transformer-engine's helpers inside ``try`` blocks, yet three of its modules go on to use
what only a successful import defines. Without transformer-engine (every CPU machine; a GPU machine
without the ``gpu`` extra) the MoE router's gating raises NameError, multi-latent attention tests a
stand-in module for the real one, and the optimizer config compares transformer-engine's version (None)
with 2.1 for the precision-aware optimizer, which the CPU-offloaded optimizer uses without it. ``apply()`` gives each name the value "not installed" stands for; it
changes nothing where transformer-engine is installed, and nothing on other megatron-core releases.
"""

from __future__ import annotations

import importlib.util

from rlmega.parallel.mcore_version import SUPPORTED, major_minor

# (major, minor) releases of megatron-core whose modules were read for these three names: 0.16 through 0.19 bind
# te_general_gemm and HAVE_TE only where transformer-engine imports, and ask is_te_min_version("2.1.0") alike.
CHECKED_MCORE_VERSIONS = SUPPORTED


def apply() -> bool:
    """Idempotent; returns whether the fixes apply here (a checked megatron-core without transformer-engine)."""
    import megatron.core

    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    if major_minor(megatron.core.__version__) not in CHECKED_MCORE_VERSIONS:
        return False
    from megatron.core.optimizer import optimizer_config
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # RouterGatingLinearFunction reads te_general_gemm, which only the transformer-engine import binds;
    # None selects its own torch matmul.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # MLA imports TE's wrapper module, which stands a MagicMock in for transformer-engine, so MLA believes
    # TE is there and calls isinstance() with a mock (TypeError).
    multi_latent_attention.HAVE_TE = False
    # OptimizerConfig asks is_te_min_version("2.1.0") (None >= Version: TypeError); not installed is not 2.1.
    optimizer_config.is_te_min_version = lambda *args, **kwargs: False
    return True
