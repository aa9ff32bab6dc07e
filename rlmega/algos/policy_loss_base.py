"""What every policy loss shares: its config's common fields, the one call signature, and the keyword form.

Each policy loss is a frozen dataclass holding that loss's options and their defaults (``PPOLossConfig``,
``GSPOLossConfig``, ...). ``config.build()`` checks the options once and returns a ``PolicyLoss``:

    loss, metrics = config.build()(logp, old_logp, advantages, response_mask, context)

with ``[B, T]`` tensors and a ``PolicyLossContext`` for what the call needs besides them (the global
denominators, rollout IS weights, a random generator). Adding an option to a loss is adding a field
to its config (and reading it in its ``compute``): the YAML section ``actor.policy_loss``, ``--from-verl``
and the keyword form below all take their options from the config's fields.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Callable, ClassVar, Iterable, Optional, Protocol

import torch

from rlmega.algos._policy_common import (
    DEFAULT_LOG_RATIO_CLAMP,
    Metrics,
    check_policy_inputs,
    detached,
    reduce_policy_loss,
)
from rlmega.algos.aggregation import LossDenominators


@dataclasses.dataclass(frozen=True)
class PolicyLossContext:
    """What a policy loss call reads besides its config and the four ``[B, T]`` tensors."""

    global_denominators: Optional[LossDenominators] = None
    """Valid tokens and sequences of the whole mini-batch on every rank (``count_loss_denominators``);
    None: this call's own."""
    rollout_is_weights: Optional[torch.Tensor] = None
    """``[B, T]`` per-token weights (``compute_rollout_correction``), detached and multiplied into the loss."""
    generator: Optional[torch.Generator] = None
    """Source of randomness of a loss that draws tokens (Clip-Cov); None: torch's global generator."""


class PolicyLoss(Protocol):
    """A built policy loss: ``(loss, metrics)`` for ``[B, T]`` log-probs, advantages and mask."""

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        context: PolicyLossContext = ...,
    ) -> tuple[torch.Tensor, Metrics]: ...


_NO_CONTEXT = PolicyLossContext()


@dataclasses.dataclass(frozen=True)
class BaseLossConfig:
    """Fields of every policy loss: how its per-token loss is aggregated (``aggregate_loss``)."""

    loss_agg_mode: str = "token-mean"
    """A key of ``LOSS_AGG_MODES``."""
    norm_horizon: Optional[float] = None
    """Constant H of ``seq-mean-token-sum-norm`` (e.g. the max response length)."""

    # The PolicyLossContext fields that the keyword form of this loss takes.
    context_fields: ClassVar[tuple[str, ...]] = ("global_denominators", "rollout_is_weights")

    def build(self) -> PolicyLoss:
        """Check the options and return the loss; each call checks its inputs' shapes and mask."""
        self.check()

        def loss(logp, old_logp, advantages, response_mask, context=_NO_CONTEXT):
            mask = check_policy_inputs(logp, old_logp, advantages, response_mask, context.rollout_is_weights)
            value, metrics = self.compute(logp, old_logp, advantages, mask, context)
            return value, detached(metrics)

        return loss

    def check(self) -> None:
        """Raise a ValueError naming an option whose value the loss cannot use."""

    def compute(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
        context: PolicyLossContext,
    ) -> tuple[torch.Tensor, Metrics]:
        """The loss and its metrics; ``mask`` is the checked bool ``[B, T]`` mask."""
        raise NotImplementedError

    def reduce(self, per_token_loss: torch.Tensor, mask: torch.Tensor, context: PolicyLossContext) -> torch.Tensor:
        """Weight ``per_token_loss`` by the context's rollout IS weights and aggregate it."""
        return reduce_policy_loss(per_token_loss, mask, context.rollout_is_weights, self.loss_agg_mode,
                                  context.global_denominators, self.norm_horizon)


@dataclasses.dataclass(frozen=True)
class RatioLossConfig(BaseLossConfig):
    """Fields of a loss that exponentiates a log-ratio."""

    log_ratio_clamp: Optional[float] = DEFAULT_LOG_RATIO_CLAMP
    """``logp - old_logp`` is clamped to ``[-c, c]`` before ``exp`` (verl: 20): a clamped token has a
    pinned value and no gradient. None disables the clamp."""


def loss_options(config_class: type[BaseLossConfig]) -> tuple[str, ...]:
    """The options of a loss that ``actor.policy_loss`` sets by name: its fields but the aggregation
    ones (which every loss has), its own before the shared log-ratio clamp."""
    aggregation = {field.name for field in dataclasses.fields(BaseLossConfig)}
    shared = {field.name for field in dataclasses.fields(RatioLossConfig)}
    names = [field.name for field in dataclasses.fields(config_class) if field.name not in aggregation]
    return tuple(sorted(names, key=lambda name: name in shared))


def loss_option_types(config_classes: Iterable[type[BaseLossConfig]]) -> dict[str, object]:
    """Every option of the given losses (``loss_options``) with its type made optional (None: the
    loss's own default), in order of first appearance; one name with two types is a TypeError."""
    types: dict[str, object] = {}
    for config_class in config_classes:
        hints = typing.get_type_hints(config_class)
        for name in loss_options(config_class):
            kind = Optional[hints[name]]
            if types.setdefault(name, kind) != kind:
                raise TypeError(f"policy loss option {name} is {types[name]} in one loss and {kind} in "
                                f"{config_class.__name__}; give it one type")
    return types


@functools.cache
def keyword_function(config_class: type[BaseLossConfig]) -> Callable[..., tuple[torch.Tensor, Metrics]]:
    """The loss as one function: ``(logp, old_logp, advantages, response_mask, *, <the config's fields>,
    <its context fields>)``, each keyword defaulting to the config's default (the context's to None).
    The signature is spelled out from the config (no ``**kwargs`` in ``inspect.signature``); one
    function per config class, named after it (``GeoMeanLossConfig``: ``geo_mean_policy_loss``)."""
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for name in ("logp", "old_logp", "advantages", "response_mask")]
    option_names = [field.name for field in dataclasses.fields(config_class)]
    options = [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                 annotation=field.type) for field in dataclasses.fields(config_class)]
    context = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
               for name in config_class.context_fields]
    signature = inspect.Signature([*positional, *options, *context])

    def policy_loss(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments  # a TypeError for an unknown keyword, as a def gives
        config = config_class(**{name: given[name] for name in option_names if name in given})
        call_context = PolicyLossContext(**{name: given[name] for name in config_class.context_fields
                                            if name in given})
        return config.build()(given["logp"], given["old_logp"], given["advantages"], given["response_mask"],
                              call_context)

    policy_loss.__signature__ = signature
    policy_loss.__doc__ = config_class.__doc__
    words = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", config_class.__name__.removesuffix("LossConfig"))
    policy_loss.__qualname__ = policy_loss.__name__ = f"{words.lower()}_policy_loss"
    policy_loss.__module__ = config_class.__module__
    return policy_loss
