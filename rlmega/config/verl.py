"""verl's PPO/GRPO trainer settings in rlmega: one table, and the translation of a verl config.

``VERL_SETTINGS`` maps every key of verl's documented trainer config (``ppo_trainer.yaml``,
``ppo_megatron_trainer.yaml``, the rollout-correction options of its docs and the DAPO recipe's
additions) to the rlmega field it becomes, or says why rlmega has none. A key is one of three kinds:

- **mapped**: its value becomes one or more rlmega fields, through a rule where the value changes;
- **not needed**: it only tunes how verl executes (kernels, micro-batch sizes, sharding, logging
  switches), or is only read with a feature that is refused elsewhere; any value is accepted and
  nothing is emitted, because the run trains the same thing without it;
- **refused**: it changes what is trained in a way rlmega cannot reproduce; a value other than verl's
  default (or null/empty) stops the translation with the reason.

``translate_verl(path, overrides)`` reads a verl YAML and verl-style overrides and returns the equivalent
rlmega overrides with a report of every setting rlmega refuses or takes differently (``verl_report``);
``translate_verl_config`` returns the overrides, or raises naming every refused setting. ``VERL.md`` beside
this file is the table as a document, with the rules.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlmega.config.verl_report import NOT_USED, REFUSED, ReportRow, VerlTranslation
from rlmega.config.verl_table import (
    SECTIONS, SKIP, VERL_SETTINGS, Refused, Setting, VerlTranslationError, find_setting,
)

# ---------------------------------------------------------------------------------------------- reading verl

def _defaults_tree() -> dict:
    """verl's defaults of every (non-wildcard) key of the table, nested: a copy of its own for each caller (one that
    edits it, as a test of verl's defaults does, changes no later translation)."""
    return copy.deepcopy(_built_defaults_tree())


@functools.lru_cache(maxsize=1)
def _built_defaults_tree() -> dict:
    tree: dict = {}
    for key, setting in VERL_SETTINGS.items():
        if key.endswith(".*"):
            continue
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise AssertionError(f"VERL_SETTINGS: {key} lies under another key's value")
        if leaf in node:
            raise AssertionError(f"VERL_SETTINGS: {key} is a key and a section")
        node[leaf] = setting.default
    return tree


def _section_paths() -> set[str]:
    return {".".join(key.split(".")[:end]) for key in VERL_SETTINGS for end in range(1, key.count(".") + 1)}


class VerlConfig:
    """One verl config as verl reads it: the file and the overrides over verl's defaults.

    ``verl(key)`` is a key's effective value (interpolations resolved); ``verl.is_set(key)`` tells whether
    it differs from what verl's default gives in this config (a default that follows another key is
    evaluated against that key's value here); ``verl.written(key)`` whether the file or an override
    gives it at all.
    """

    def __init__(self, tree: Any):
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        self._written = set(_leaves(tree, ""))
        try:
            self._tree = OmegaConf.merge(OmegaConf.create(_defaults_tree()), tree)
        except OmegaConfBaseException as error:
            key = getattr(error, "full_key", None) or "?"
            raise VerlTranslationError(f"verl {key}: the value does not fit verl's layout of that key: "
                                       f"{str(error).splitlines()[0]}") from None
        self._values: dict[str, Any] = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike, overrides: Sequence[str] = ()) -> VerlConfig:
        from omegaconf import DictConfig, OmegaConf

        path = Path(path)
        if not path.is_file():
            raise VerlTranslationError(f"{path}: no such verl config file")
        tree = OmegaConf.load(path)
        if not isinstance(tree, DictConfig):
            raise VerlTranslationError(f"{path}: a verl config is a mapping at the top level")
        defaults = [item for item in (tree.pop("defaults", None) or []) if item != "_self_"]
        if defaults:
            raise VerlTranslationError(
                f"{path}: its Hydra defaults list ({', '.join(map(str, defaults))}) composes verl's own config files, "
                "which rlmega cannot follow; translate the composed config instead (verl prints it with "
                "'python -m verl.trainer.main_ppo --config-path=DIR --config-name=NAME --cfg job')")
        tree.pop("hydra", None)  # Hydra's own run settings
        _apply_overrides(tree, overrides)
        _drop_null_sections(tree, "", _section_paths())
        return cls(tree)

    def __call__(self, key: str) -> Any:
        if key not in self._values:
            self._values[key] = self._resolve(key)
        return self._values[key]

    def _resolve(self, key: str) -> Any:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            value = OmegaConf.select(self._tree, key, throw_on_missing=False)
            return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except OmegaConfBaseException as error:
            raise VerlTranslationError(f"verl {key}: cannot resolve its value: {str(error).splitlines()[0]}") from None

    def default(self, key: str) -> Any:
        """What verl's default gives for ``key`` in this config."""
        from omegaconf import OmegaConf

        setting = find_setting(key)
        default = None if setting is None else setting.default
        if not (isinstance(default, str) and "${" in default):
            return default
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(self._tree, parent_key) if parent_key else self._tree
        saved = OmegaConf.to_container(parent, resolve=False)[leaf]
        parent[leaf] = default
        try:
            return self._resolve(key)
        finally:
            parent[leaf] = saved

    def is_set(self, key: str) -> bool:
        return self(key) != self.default(key)

    def written(self, key: str) -> bool:
        return key in self._written

    def keys_written_under(self, prefix: str) -> list[str]:
        return [key for key in self._written if key.startswith(prefix + ".")]

    def keys(self) -> list[str]:
        """Every key the config holds: the table's and the file's, whole where the table takes a whole mapping."""
        return [key for key in _leaves(self._tree, "") if key.rpartition(".")[2] != "_target_"]

    def keys_under(self, prefix: str) -> list[str]:
        return [key for key in self.keys() if key.startswith(prefix + ".")]


def _leaves(node: Any, prefix: str) -> Iterator[str]:
    from omegaconf import DictConfig, OmegaConf

    for name in node.keys():
        key = f"{prefix}{name}"
        if key in VERL_SETTINGS or OmegaConf.is_missing(node, name) or OmegaConf.is_interpolation(node, name):
            yield key
            continue
        value = node[name]
        if isinstance(value, DictConfig):
            yield from _leaves(value, key + ".")  # an empty mapping sets nothing
        else:
            yield key


def _apply_overrides(tree: Any, overrides: Sequence[str]) -> None:
    """verl-style command-line overrides (Hydra syntax; ``+`` and ``++`` add, ``~`` deletes) onto ``tree``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException as error:
            raise VerlTranslationError(f"verl override {text!r}: {str(error).splitlines()[0]}") from None
        if override.is_sweep_override():
            raise VerlTranslationError(f"verl override {text!r}: a sweep is several runs; translate each run alone")
        key = override.key_or_group
        if not key:
            raise VerlTranslationError(f"verl override {text!r}: no key")
        if override.is_delete():
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(tree, parent_key) if parent_key else tree
            if parent is not None and leaf in parent:
                del parent[leaf]
            continue
        try:
            OmegaConf.update(tree, key, override.value(), merge=True, force_add=True)
        except (OmegaConfBaseException, ValueError, TypeError) as error:  # e.g. a key under a list
            raise VerlTranslationError(f"verl override {text!r}: {str(error).splitlines()[0]}") from None


def _drop_null_sections(node: Any, prefix: str, sections: set[str]) -> None:
    """``section: null`` (verl's way to turn off e.g. rollout_correction) leaves that section at verl's defaults."""
    from omegaconf import DictConfig, OmegaConf

    for name in list(node.keys()):
        key = f"{prefix}{name}"
        if (key not in sections or key in VERL_SETTINGS or OmegaConf.is_missing(node, name)
                or OmegaConf.is_interpolation(node, name)):
            continue
        value = node[name]
        if value is None:
            del node[name]
        elif isinstance(value, DictConfig):
            _drop_null_sections(value, key + ".", sections)


# ---------------------------------------------------------------------------------------------- translating

def translate_verl_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> list[str]:
    """The rlmega overrides (Hydra syntax) equivalent to the verl config at ``path`` with verl-style
    ``overrides`` (``actor_rollout_ref.rollout.n=8``; ``+``/``++`` prefixes are accepted); a
    ``RefusedSettings`` error naming every setting that cannot cross over, when there is one
    (``translate_verl`` says which, and which settings rlmega takes differently)."""
    return translate_verl(path, overrides).check()


def translate_verl(path: str | os.PathLike, overrides: Sequence[str] = ()) -> VerlTranslation:
    """The verl config at ``path`` with verl-style ``overrides``, translated: the rlmega overrides, the
    settings rlmega takes differently, and the ones it refuses, all of them at once.

    A mapped key is translated when the file or the overrides give it, and, for what is trained, from
    verl's default too (``Setting.carry``). Refused: a key the table does not know (with the nearest known
    key), a refused key set to a value other than verl's default or null/empty (and not one rlmega honours),
    a verl value rlmega cannot take, two verl keys that give one rlmega field different values, and a
    mapped field this rlmega's schema lacks when the config gives that key a value other than verl's
    default. Taken differently (reported): a key the config sets whose rlmega value is not verl's value
    as it is, or whose rlmega field works differently (``Setting.caveat``), and a key rlmega does not need
    set to a value other than verl's default. A config verl itself could not read raises
    VerlTranslationError at once.
    """
    verl = VerlConfig.from_file(path, overrides)
    refused: list[ReportRow] = []
    changed: list[ReportRow] = []
    found: dict[str, list[tuple[str, Any, bool]]] = {}
    for key in verl.keys():
        setting = find_setting(key)
        if setting is None:
            refused.append(_row(verl, key, REFUSED, f"not a verl trainer setting rlmega knows; the nearest known key "
                                                    f"is {_nearest(key)}"))
            continue
        try:
            contributions = _contributions(key, setting, verl)
        except Refused as reason:
            refused.append(_row(verl, key, REFUSED, str(reason)))
            continue
        for target, value, given in contributions:
            found.setdefault(target, []).append((key, value, given))
        report = _report(key, setting, contributions, verl)
        if report is not None:
            changed.append(report)
    overrides_out = []
    for target, items in found.items():
        chosen = [item for item in items if item[2]] or items  # a value the config gives beats verl's default
        distinct = {hydra_value(value): (key, value) for key, value, _ in chosen}
        if len(distinct) > 1:
            (key1, value1), (key2, value2) = list(distinct.values())[:2]
            refused.append(_row(verl, key2, REFUSED, f"{key1}={_shown(verl(key1))} gives rlmega's {target} "
                                                     f"{hydra_value(value1)}, this gives {hydra_value(value2)}; "
                                                     f"rlmega has one {target}"))
            continue
        if not rlmega_field_exists(target):
            refused += [_row(verl, key, REFUSED, f"maps to rlmega's {target}, which this rlmega's config schema does "
                                                 "not have yet") for key, _, _ in chosen if verl.is_set(key)]
            continue  # verl's default value for a field rlmega does not have yet
        overrides_out.append(f"{target}={hydra_value(chosen[0][1])}")
    return VerlTranslation(overrides_out, changed, refused)


def _row(verl: VerlConfig, key: str, rlmega: str, why: str) -> ReportRow:
    return ReportRow(key, _shown(verl(key)), rlmega, why)


def _contributions(key: str, setting: Setting, verl: VerlConfig) -> list[tuple[str, Any, bool]]:
    """``(rlmega field, value, whether the config gives the key)`` for each field ``key`` gives a value;
    Refused when the key's value cannot cross over."""
    value = verl(key)
    if not setting.targets:
        if setting.refused and not _unset(value) and verl.is_set(key) and not (
                setting.accept and setting.accept(value, verl)):
            raise Refused(setting.note)
        return []
    given = verl.is_set(key) or verl.written(key)
    if not (given or setting.carry):
        return []
    out = setting.rule(value, verl) if setting.rule else value
    if out is SKIP:
        return []
    values = out if len(setting.targets) > 1 else (out,)
    return [(target, item, given) for target, item in zip(setting.targets, values) if item is not SKIP]


def _report(key: str, setting: Setting, contributions: list[tuple[str, Any, bool]],
            verl: VerlConfig) -> ReportRow | None:
    """The row of a key the config sets that rlmega takes differently; None when it takes it as it is."""
    value = verl(key)
    if not setting.targets:  # a key rlmega does not need, set to a value other than verl's default
        return _row(verl, key, NOT_USED, setting.note) if (
            not setting.refused and verl.written(key) and verl.is_set(key)) else None
    if not (verl.written(key) or verl.is_set(key)):
        return None
    if not contributions:
        return _row(verl, key, NOT_USED, setting.note or "not read in this configuration")
    if not setting.caveat and all(_same_value(out, value) for _, out, _ in contributions):
        return None
    becomes = ", ".join(f"{target}={hydra_value(out)}" for target, out, _ in contributions)
    return _row(verl, key, becomes, setting.note or "the same setting under rlmega's name")


def _same_value(rlmega: Any, verl: Any) -> bool:
    """Whether rlmega's value is verl's as it is (a single file is a list of one in rlmega)."""
    if isinstance(rlmega, list) and len(rlmega) == 1 and not isinstance(verl, list):
        rlmega = rlmega[0]
    if isinstance(rlmega, bool) or isinstance(verl, bool):
        return rlmega is verl
    return rlmega == verl


def _shown(value: Any, limit: int = 80) -> str:
    text = hydra_value(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _unset(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def _nearest(key: str) -> str:
    """The closest known key; among keys with the same last part first (a setting under the wrong section)."""
    known = [name[:-2] if name.endswith(".*") else name for name in VERL_SETTINGS]
    leaf = key.rpartition(".")[2]
    same_leaf = [name for name in known if name.rpartition(".")[2] == leaf]
    return difflib.get_close_matches(key, same_leaf or known, n=1, cutoff=0.0)[0]


@functools.lru_cache(maxsize=1)
def _schema_defaults() -> Any:
    from rlmega.config.schema import RLConfig

    return RLConfig()


def rlmega_field_exists(dotted: str) -> bool:
    """Whether ``dotted`` (``actor.optimizer.lr``) names a field of rlmega's config tree."""
    node = _schema_defaults()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {field.name for field in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


_BARE = re.compile(r"[A-Za-z_][\w\-.]*")
_WORDS = ("true", "false", "null", "none", "nan", "inf")


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override syntax, read back as the same value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if _BARE.fullmatch(value) and value.lower() not in _WORDS:
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{hydra_value(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"no Hydra spelling for {type(value).__name__} {value!r}")


# ---------------------------------------------------------------------------------------------- the document

def markdown_table() -> str:
    """The table as VERL.md shows it, section by section (VERL.md holds this text; a test checks it)."""
    kinds = [setting.kind for setting in VERL_SETTINGS.values()]
    lines = [f"{len(kinds)} verl keys (a `prefix.*` row covers every key under it): "
             f"{kinds.count('mapped')} mapped, {kinds.count('not needed')} not needed, "
             f"{kinds.count('refused')} refused."]
    for section in SECTIONS:
        rows = [(key, setting) for key, setting in VERL_SETTINGS.items() if _section_of(key) == section]
        if not rows:
            continue
        lines += ["", f"### `{section}`", "", "| verl key | verl default | rlmega field | notes |", "|---|---|---|---|"]
        for key, setting in rows:
            if setting.kind == "mapped":
                field = ", ".join(f"`{target}`" for target in setting.targets) + (" (carried)" if setting.carry else "")
            else:
                field = setting.kind
            default = "" if key.endswith(".*") else f"`{_doc_value(setting.default)}`"
            lines.append(f"| `{key}` | {default} | {field} | {setting.note} |")
    return "\n".join(lines) + "\n"


def _doc_value(value: Any) -> str:
    return value if isinstance(value, str) and ("${" in value or value == "???") else hydra_value(value)


def _section_of(key: str) -> str:
    return max((section for section in SECTIONS if key.startswith(section + ".")), key=len)
