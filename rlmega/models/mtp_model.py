"""GPTModel for models with multi-token prediction (DeepSeek-V3's MTP layers) whose forward
without labels skips MTP and returns the main logits.

Megatron-Core (0.16 through 0.19) runs the MTP layers and their loss whenever ``mtp_num_layers`` is set, and
calls ``labels.clone()`` for it; logits-only forwards (log-probabilities, evaluation) have no
labels (0.19 hands them to ``process_mtp_loss``), and MTP never changes the main logits. (The MTP layers then get no gradient: a step that
should train them must pass labels.)

The subclass overrides ``GPTModel._postprocess``, a private method, so it is gated to the
megatron-core releases it was checked against and refuses others by name.
"""

from __future__ import annotations

import copy
import functools

from rlmega.parallel.mcore_version import SUPPORTED, at_least, require_checked

# Read for each: _postprocess takes (hidden_states, input_ids, position_ids, labels, ...) with the keyword
# mtp_in_postprocess, and skips MTP when config.mtp_num_layers is None (0.19 added keywords after labels only).
CHECKED_MCORE_VERSIONS = SUPPORTED


def check_mcore_version(version: str) -> None:
    require_checked(
        version, CHECKED_MCORE_VERSIONS,
        "models with MTP layers override GPTModel._postprocess as megatron-core {checked} defines it, "
        "not {version}'s; install '{install}' or drop the MTP layers (num_nextn_predict_layers=0)",
    )


# Where Megatron's MultiTokenPredictionLayer holds its transformer layer: ``transformer_layer`` in 0.16,
# ``mtp_model_layer`` from 0.17 on (it may hold a hybrid stack there). rlmega's canonical names keep 0.16's, so
# the HF mapping, layout pieces and converted checkpoints name an MTP layer's weights alike on every release.
CANONICAL_INNER_LAYER = "transformer_layer"


def inner_layer_attribute() -> str:
    """The installed release's name of an MTP layer's transformer layer (imports megatron.core)."""
    return "mtp_model_layer" if at_least(17) else CANONICAL_INNER_LAYER


def canonical_inner_name(name: str) -> str:
    """``name`` inside an MTP layer (``mtp_model_layer.mlp...`` on 0.17+) with the canonical inner layer's name."""
    inner = inner_layer_attribute() + "."
    return CANONICAL_INNER_LAYER + "." + name[len(inner):] if name.startswith(inner) else name


def canonical_layer_index(model, mtp_layer) -> int:
    """The index rlmega names an MTP layer by: its transformer layer's, after the decoder's (``num_layers + k``).
    Read from the MTP layer itself, whose ``layer_number`` is k + 1 on every release (its transformer layer's
    continues the decoder's numbering in 0.16 but restarts at 1 from 0.17 on)."""
    return model.config.num_layers + mtp_layer.layer_number - 1


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
