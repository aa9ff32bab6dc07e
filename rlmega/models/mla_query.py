"""Multi-latent attention without a query down-projection (``q_lora_rank`` None, DeepSeek-V2-Lite's) computing the
query as HF does: ``q_proj`` straight on the layer's normed input, with no norm of its own.

Megatron-Core 0.19 resolves MLA's query and key-value norms in one place (``QKNormConfigResolver``): with
``qk_layernorm`` on (the key-value norm HF's ``kv_a_layernorm`` needs) and no query down-projection, it refuses a
query norm in the spec and fuses a norm into ``linear_q_proj`` instead, a second norm with a weight HF does not have.
0.16 to 0.18 build the spec's ``linear_q_proj`` as given. ``attention_without_query_norm`` gives the class whose
resolution keeps the spec's ``linear_q_proj`` and no query norm on 0.19, and Megatron's own class before it.
"""

from __future__ import annotations

import dataclasses
import functools

from rlmega.parallel.mcore_version import at_least


@functools.cache
def attention_without_query_norm() -> type:
    """The self-attention class of MLA layers without a query down-projection (imports megatron.core)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not at_least(19):  # no resolver: the spec's linear_q_proj is built, its q_layernorm never is
        return MLASelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    class MLASelfAttentionWithoutQueryNorm(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules):
            if self.config.q_lora_rank is not None:
                return super()._resolve_qk_norm_config(submodules)
            resolved = super()._resolve_qk_norm_config(dataclasses.replace(submodules, q_layernorm=IdentityOp))
            resolved["linear_q_proj"] = submodules.linear_q_proj  # the plain projection, not a fused norm+linear
            return resolved

    return MLASelfAttentionWithoutQueryNorm
