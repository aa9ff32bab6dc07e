"""The pinned engines' API as recorded from their wheels (``api/<package>.json``, written by
``tests/rollout/engine_api_snapshot.py``), and the checks every fake call goes through.

``check_call(API, "LLM.generate", *args, **kwargs)`` binds the call to the recorded signature: a keyword
the release does not have, or a missing required argument, raises ``TypeError`` naming the release.
``check_fields(API, "SamplingParams", kwargs)`` does the same for the keyword arguments of a request or
config class. The snapshot is read here, so the tests need no wheel.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

API_DIR = Path(__file__).parent / "api"


@functools.cache
def load(package: str) -> dict:
    return json.loads((API_DIR / f"{package}.json").read_text())


def _signature(params: list[list]) -> inspect.Signature:
    parameters = []
    for name, kind, _default, has_default in params:
        default = inspect.Parameter.empty
        if has_default and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            default = None  # the value is irrelevant to binding
        parameters.append(inspect.Parameter(name, getattr(inspect.Parameter, kind), default=default))
    return inspect.Signature(parameters)


def check_call(api: dict, qualified: str, /, *args, **kwargs) -> None:
    entry = api["signatures"].get(qualified)
    if entry is None:
        raise AttributeError(f"{api['package']} {api['version']} has no {qualified} ({sorted(api['signatures'])})")
    try:
        _signature(entry["params"]).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{api['package']} {api['version']} {qualified} ({entry['file']}): {error}") from None


def field_names(api: dict, cls: str) -> list[str]:
    return [field[0] for field in api["fields"][cls]["fields"]]


def required_fields(api: dict, cls: str) -> list[str]:
    return [field[0] for field in api["fields"][cls]["fields"] if not field[3]]


def check_fields(api: dict, cls: str, given, *, complete: bool = False) -> None:
    """Every key of ``given`` is a field of ``cls``; with ``complete``, every required field is given."""
    names = set(field_names(api, cls))
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"{api['package']} {api['version']} {cls} ({api['fields'][cls]['file']}) has no "
                        f"field(s) {unknown}")
    if complete:
        missing = [name for name in required_fields(api, cls) if name not in given]
        if missing:
            raise TypeError(f"{api['package']} {api['version']} {cls} requires {missing}")


def check_env(api: dict, name: str) -> None:
    if name not in api["env"]:
        raise KeyError(f"{api['package']} {api['version']} reads no environment variable {name!r}")


def checked(api: dict, qualified: str):
    """A fake's method decorator: bind every call to the recorded signature before the fake runs it."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            check_call(api, qualified, *args, **kwargs)
            return method(self, *args, **kwargs)
        return call
    return wrap


@functools.cache
def load_multimodal(package: str) -> dict:
    """``api/<package>_multimodal.json``: how images travel with a token prompt (``fakes/multimodal_snapshot.py``)."""
    return json.loads((API_DIR / f"{package}_multimodal.json").read_text())


@functools.cache
def _rules() -> dict:
    return json.loads((API_DIR / "rules.json").read_text())


def rule(package: str, name: str) -> dict:
    """``api/rules.json``: one validation rule of ``package``'s pinned releases, as read from the wheel (``where``)."""
    return _rules()[package][name]


def refusal(package: str, name: str, case: str | None = None, /, **fields) -> str:
    """The message a rule's wheel raises, with ``fields`` filled in; ``case``: which of a rule's ``messages``."""
    found = rule(package, name)
    return (found["message"] if case is None else found["messages"][case]).format(**fields)
