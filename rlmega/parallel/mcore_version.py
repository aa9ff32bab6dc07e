"""The megatron-core releases rlmega supports, and gating code that depends on Megatron-Core internals to them.

Every module that reaches into Megatron beyond its public API names the (major, minor) releases it was read
against; these helpers refuse any other release by name rather than half-patching it.
"""

from __future__ import annotations

# (major, minor) releases rlmega supports: 0.16 (the newest for Python 3.11) and 0.19 run the Megatron-facing CPU
# suites (launch/run_tests.sh --mcore 0.19); 0.17 and 0.18 were read at every change found between the two, and
# the same flag runs the suites on them.
SUPPORTED = ((0, 16), (0, 17), (0, 18), (0, 19))
# setup.py's range, and what a refusal tells to install.
PIP_RANGE = "megatron-core>=0.16,<0.20"
# transformer-engine releases [lowest, below) that go with each megatron-core release: 0.16's own tested range
# (its "dev" extra); from 0.17 on Megatron pins none, so from the oldest its code expects (the highest
# is_te_min_version it asks below the newest: 2.10 for 0.17, 2.12 for 0.18 and 0.19) through 2.20, the release
# that goes with torch 2.14. setup.py's gpu extra gives 0.16's range on Python 3.11 and 0.19's on 3.12.
TRANSFORMER_ENGINE = {
    (0, 16): ((2, 9), (2, 12)),
    (0, 17): ((2, 10), (2, 21)),
    (0, 18): ((2, 12), (2, 21)),
    (0, 19): ((2, 12), (2, 21)),
}


def major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def installed() -> tuple[int, int]:
    """The installed megatron-core's (major, minor); imports megatron.core."""
    import megatron.core

    return major_minor(megatron.core.__version__)


def at_least(minor: int) -> bool:
    """Whether the installed megatron-core is 0.``minor`` or later (the one test every version branch uses)."""
    return installed() >= (0, minor)


def describe(checked: tuple[tuple[int, int], ...]) -> str:
    """``((0, 16), (0, 17))`` -> "0.16.x through 0.17.x"; a single release or a gap lists them."""
    names = [f"{a}.{b}.x" for a, b in checked]
    contiguous = all(b == a + 1 for (_, a), (_, b) in zip(checked, checked[1:])) and len({m for m, _ in checked}) == 1
    return f"{names[0]} through {names[-1]}" if contiguous and len(names) > 2 else ", ".join(names)


def require_checked(version: str, checked: tuple[tuple[int, int], ...], refusal: str) -> None:
    """Raise RuntimeError unless ``version`` is one of the ``checked`` (major, minor) releases.

    ``refusal`` is the message, formatted with ``{checked}`` (e.g. "0.16.x through 0.19.x"), ``{version}`` and
    ``{install}`` (the pip requirement of the supported range).
    """
    if major_minor(version) not in checked:
        raise RuntimeError(refusal.format(checked=describe(checked), version=version, install=PIP_RANGE))
