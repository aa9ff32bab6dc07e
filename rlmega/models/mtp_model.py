"""GPTModel for models with multi-token prediction (DeepSeek-V3's MTP layers) whose forward
without labels skips MTP and returns the main logits.

Megatron-Core 0.16 runs the MTP layers and their loss whenever ``mtp_num_layers`` is set, and
calls ``labels.clone()`` for it; logits-only forwards (log-probabilities, evaluation) have no
labels, and MTP never changes the main logits. (The MTP layers then get no gradient: a step that
should train them must pass labels.)

The subclass overrides ``GPTModel._postprocess``, a private method, so it is gated to the
megatron-core releases it was checked against and refuses others by name.
"""

from __future__ import annotations

import copy
import functools

from rlmega.parallel.mcore_version import require_checked

CHECKED_MCORE_VERSIONS = ((0, 16),)


def check_mcore_version(version: str) -> None:
    require_checked(
        version, CHECKED_MCORE_VERSIONS,
        "models with MTP layers override GPTModel._postprocess as megatron-core {checked} defines it, "
        "not {version}'s; install 'megatron-core==0.16.*' or drop the MTP layers (num_nextn_predict_layers=0)",
    )


@functools.cache
def gpt_model_with_mtp():
    """The ``GPTModel`` subclass (built on first use: Megatron is imported lazily)."""
    import megatron.core
    from megatron.core.models.gpt import GPTModel

    check_mcore_version(megatron.core.__version__)

    class GPTModelWithMTP(GPTModel):
        def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
            if labels is not None:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            # A config without MTP for this module's _postprocess only; its layers keep the shared one.
            shared_config, self.config = self.config, copy.copy(self.config)
            self.config.mtp_num_layers = None
            kwargs["mtp_in_postprocess"] = False
            try:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            finally:
                self.config = shared_config

    return GPTModelWithMTP
