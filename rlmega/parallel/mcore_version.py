"""Gating code that depends on Megatron-Core internals to the releases it was checked against."""

from __future__ import annotations


def major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def require_checked(version: str, checked: tuple[tuple[int, int], ...], refusal: str) -> None:
    """Raise RuntimeError unless ``version`` is one of the ``checked`` (major, minor) releases.

    ``refusal`` is the message, formatted with ``{checked}`` (e.g. "0.16.x") and ``{version}``.
    """
    if major_minor(version) not in checked:
        listed = ", ".join(f"{a}.{b}.x" for a, b in checked)
        raise RuntimeError(refusal.format(checked=listed, version=version))
