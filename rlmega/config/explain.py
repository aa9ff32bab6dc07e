"""Why a config did not load, in one line: Hydra, OmegaConf and YAML errors read against the schema.

Hydra's own message keeps the least useful line ("Could not override 'trainer.totl_epochs'.") and
puts the reason in the exception's cause; ``explain`` says what is wrong with which key and how to
fix it, e.g. ``trainer.totl_epochs: no such field; did you mean trainer.total_epochs?``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Sequence

from rlmega.config.schema import RLConfig

# The config groups of configs/ that overrides and defaults lists can pick from (``algo=dapo``);
# configs/verl/ holds verl-format files for --from-verl, not a group.
CONFIG_GROUPS = ("algo",)

_TYPE_NAMES = {int: "an int", float: "a number", bool: "true or false", str: "a string", list: "a list",
               tuple: "a list", dict: "a mapping", Any: "a value"}


def schema_fields(cls: type = RLConfig, prefix: str = "") -> dict[str, Any]:
    """Every dotted field of the dataclass tree under ``cls``, sections included, with its type:
    ``{"trainer": TrainerConfig, "trainer.total_steps": int, ..., "rollout.engine_kwargs": dict[str, Any]}``."""
    fields: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        fields[prefix + field.name] = kind
        nested = [option for option in _options(kind) if dataclasses.is_dataclass(option)]
        if nested:
            fields.update(schema_fields(nested[0], f"{prefix}{field.name}."))
    return fields


def extra_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted names of attributes that a loaded config holds but its dataclasses do not declare
    (OmegaConf sets a ``+key=value`` on a dataclass node as a plain attribute, which nothing reads)."""
    names = [field.name for field in dataclasses.fields(node)]
    for name in getattr(node, "__dict__", {}):
        if name not in names:
            yield prefix + name
    for name in names:
        value = getattr(node, name)
        if dataclasses.is_dataclass(value):
            yield from extra_keys(value, f"{prefix}{name}.")


def no_such_field(key: str, overrides: Sequence[str] = ()) -> str:
    """The message for a key the schema does not have: the nearest field, or the free-form ``+`` spelling."""
    fields = schema_fields()
    parent, _, leaf = key.rpartition(".")
    parent_type = fields.get(parent)
    if parent and _is_mapping(parent_type):
        given = next((o.lstrip("+") for o in overrides if f"{o.lstrip('+').partition('=')[0]}.".startswith(f"{key}.")),
                     f"{key}=...")
        return (f"{key}: not a field of the schema; free-form keys of {parent} need a leading +, "
                f"as in +{given}")
    siblings = [name.rpartition(".")[2] for name in fields if name.rpartition(".")[0] == parent]
    if not parent:
        siblings += CONFIG_GROUPS
    guess = difflib.get_close_matches(leaf, siblings, n=1)
    if guess:
        return f"{key}: no such field; did you mean {parent + '.' if parent else ''}{guess[0]}?"
    elsewhere = difflib.get_close_matches(key, [name for name in fields if name.rpartition(".")[2] == leaf], n=1,
                                          cutoff=0)
    if elsewhere:
        return f"{key}: no such field; did you mean {elsewhere[0]}?"
    if not siblings:
        return f"{key}: no such field"
    return f"{key}: no such field; {parent or 'the config'} has: {', '.join(siblings)}"


def explain(error: BaseException, overrides: Sequence[str], config_dirs: Sequence[Path]) -> str:
    """One line for an error raised while composing or building the config: what is wrong, with
    which key (and in which file, when a YAML file holds it), and how to fix it."""
    import yaml
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, MissingMandatoryValue,
                                  OmegaConfBaseException, ValidationError)

    chain = list(_chain(error))
    syntax = next((e for e in chain if isinstance(e, yaml.YAMLError)), None)
    if syntax is not None:
        return _yaml_error(syntax)
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        valid = f"choose one of {', '.join(error.options)}" if error.options else f"there is no config group {group}"
        message = f"{group}={option}: no such option; {valid}" if group else _one_line(str(error))
        given = any(o.lstrip("+").partition("=")[0] == group for o in overrides)
        return message if given else _in_file(error, config_dirs) + message
    if isinstance(error, OverrideParseException):
        reasons = [line for line in str(error).splitlines() if not line.startswith(("Error parsing", "See http"))]
        return (f"{getattr(error, 'override', None) or 'override'}: not an override ({'; '.join(reasons)}); "
                "write key=value, and quote a value with spaces or '=' (key='a=b')")
    cause = next((e for e in chain if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None)), None)
    if cause is None:
        return _one_line(str(error))
    key = str(cause.full_key)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        message = no_such_field(key, overrides)
    elif isinstance(cause, MissingMandatoryValue):
        message = f"{key}: required, and nothing sets it; give it, as in {key}=..."
    elif isinstance(cause, ValidationError) and key in schema_fields():
        expected = _describe(schema_fields()[key])
        message = f"{key}: expected {expected}, got {'null' if cause.value is None else repr(cause.value)}"
    else:
        message = f"{key}: {str(cause.msg or cause).splitlines()[0]}"  # later lines repeat the key and types
    return _in_file(error, config_dirs) + message


def _options(kind: Any) -> tuple:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return typing.get_args(kind)
    return (kind,)


def _is_mapping(kind: Any) -> bool:
    return any(option is dict or typing.get_origin(option) is dict for option in _options(kind))


def _describe(kind: Any) -> str:
    names = []
    for option in _options(kind):
        if option is type(None):
            continue
        if dataclasses.is_dataclass(option):
            names.append(f"a mapping of {option.__name__} fields")
        else:
            names.append(_TYPE_NAMES.get(typing.get_origin(option) or option, getattr(option, "__name__", str(option))))
    text = " or ".join(names)
    if "a list" in names:
        text += " such as [a,b]"
    return text + (" or null" if type(None) in _options(kind) else "")


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _in_file(error: BaseException, config_dirs: Sequence[Path]) -> str:
    """``path/of/file.yaml: `` when Hydra says the error is in a file's contents ("In 'name': ..."), else ``""``."""
    match = re.match(r"In '([^']+)'", str(error))
    if not match or re.match(r"(Could not override|Error merging override)", str(error)):
        return ""
    for directory in config_dirs:
        path = Path(directory) / f"{match.group(1)}.yaml"
        if path.is_file():
            return f"{path}: "
    return f"{match.group(1)}: "


def _yaml_error(error: Any) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or _one_line(str(error))
    if mark is None:
        return f"not valid YAML: {problem}"
    return f"{mark.name} line {mark.line + 1}: not valid YAML: {problem} (column {mark.column + 1})"


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines)
