"""How one verl setting crosses over (``Setting``) and the ways to declare one (``trained``, ``mapped``,
``needless``, ``refused``): the vocabulary of the table in ``rlmega.config.verl_table``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from rlmega.config.verl import VerlConfig


class VerlTranslationError(ValueError):
    """A verl setting that cannot cross over: one line naming the verl key and the reason."""


class Refused(Exception):
    """Raised by a rule: this verl value has no rlmega equivalent (the message says why)."""


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()
"""A rule's answer when the value does not reach rlmega (e.g. a critic setting in a run without a critic)."""

Rule = Callable[[Any, "VerlConfig"], Any]


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one verl key crosses over."""

    default: Any
    """verl's default as verl writes it (an interpolation where verl's default follows another key)."""
    targets: tuple[str, ...] = ()
    """The rlmega fields (dotted) the value goes to; empty: none."""
    rule: Optional[Rule] = None
    """``(value, verl) -> value for the targets`` (a tuple for several), SKIP, or ``raise Refused``;
    None: the value as it is."""
    note: str = ""
    """Mapped: how the value changes, where it does. Otherwise: why rlmega has no field."""
    refused: bool = False
    """A value other than verl's default (or null/empty) stops the translation."""
    accept: Optional[Callable[[Any, "VerlConfig"], bool]] = None
    """The values of a refused key that rlmega honours anyway."""
    carry: bool = False
    """Translate verl's default too, not only a value the config sets: for what is trained (algorithm,
    sampling, batch sizes, optimizer, loss), where rlmega's default may differ from verl's."""
    caveat: bool = False
    """Mapped: the value crosses as it is, but rlmega's field works differently (the note says how), so the
    translation reports it whenever the config sets the key."""

    @property
    def kind(self) -> str:
        if self.targets:
            return "mapped"
        return "refused" if self.refused else "not needed"


def trained(*targets: str, default: Any, rule: Optional[Rule] = None, note: str = "") -> Setting:
    """A mapped key whose verl default is carried over."""
    return Setting(default, targets, rule, note, carry=True)


def mapped(*targets: str, default: Any, rule: Optional[Rule] = None, note: str = "") -> Setting:
    """A mapped key that is translated only when the config sets it."""
    return Setting(default, targets, rule, note)


def needless(reason: str, default: Any = None) -> Setting:
    return Setting(default, note=reason)


def refused(reason: str, default: Any = None, accept: Optional[Callable[[Any, "VerlConfig"], bool]] = None) -> Setting:
    return Setting(default, note=reason, refused=True, accept=accept)
