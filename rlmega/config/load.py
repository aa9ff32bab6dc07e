"""Loading a run's configuration: schema defaults <- YAML <- command-line overrides, then validation.

Hydra composes the YAML (its ``defaults`` list can pull config groups such as ``algo: dapo``) on
top of the ``RLConfig`` schema registered in Hydra's ConfigStore; unknown keys and wrong types are
refused by name. ``validate`` then checks what types cannot (files exist, sizes divide, the layout
fits the model) once, before anything starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from rlmega.config.schema import ALGORITHMS, PLACEMENTS, RLConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SCHEMA_NAME = "rlmega_schema"


class ConfigError(ValueError):
    """A configuration value that cannot work; the message starts with the field's dotted name."""


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLConfig)


def _locate(name_or_path: str) -> tuple[Path, str]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        return path.resolve().parent, path.stem
    if not (CONFIG_DIR / f"{name_or_path}.yaml").is_file():
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"--config: no config named {name_or_path!r} in {CONFIG_DIR}; available: {', '.join(available)}")
    return CONFIG_DIR, name_or_path


def load_config(name_or_path: str = "tiny_cpu", overrides: Sequence[str] = (), *, check: bool = True) -> RLConfig:
    """The run configuration from a config name (``configs/<name>.yaml``) or a YAML path, with
    Hydra-syntax ``overrides`` (``trainer.total_steps=10``, ``algo=dapo``). Validated unless ``check=False``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    directory, name = _locate(name_or_path)
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            composed = compose(config_name=name, overrides=list(overrides))
        config = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(f"{name_or_path}: {error}".splitlines()[0] + _hint(error)) from error
    except (ValueError, TypeError) as error:  # a component config's own check (__post_init__)
        raise ConfigError(f"{name_or_path}: {error}") from error
    if not isinstance(config, RLConfig):
        raise ConfigError(f"{name_or_path}: the YAML must list '{SCHEMA_NAME}' first in its defaults")
    if check:
        validate(config)
    return config


def _hint(error: Exception) -> str:
    key = getattr(error, "full_key", None)
    return f" (field {key})" if key and str(key) not in str(error).splitlines()[0] else ""


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field}: {message}")


def validate(config: RLConfig) -> None:
    """Raise ConfigError naming the first field that cannot work."""
    from rlmega.models import UnsupportedModelError, model_spec_from_hf
    from rlmega.parallel.layout import LayoutError, ParallelLayout

    _require(config.resume in ("auto", "never"), "resume", f"must be auto or never, got {config.resume!r}")
    _require(config.algorithm.name in ALGORITHMS, "algorithm.name",
             f"{config.algorithm.name!r} is not one of {', '.join(ALGORITHMS)}")
    _require(config.rollout.placement in PLACEMENTS, "rollout.placement",
             f"{config.rollout.placement!r} is not one of {', '.join(PLACEMENTS)}")
    _require(config.rollout.engine_spread in ("pack", "spread"), "rollout.engine_spread", "must be pack or spread")
    _require(config.rollout.backend in ("hf", "vllm", "sglang"), "rollout.backend",
             f"{config.rollout.backend!r} is not one of hf, vllm, sglang")
    _require(config.rollout.num_engines >= 1, "rollout.num_engines", "must be >= 1")
    _require(config.rollout.n >= 1, "rollout.n", "must be >= 1")
    _require(not config.algorithm.dynamic_sampling or config.rollout.n > 1, "algorithm.dynamic_sampling",
             "needs rollout.n > 1 (a group of one always has equal scores)")
    _require(config.algorithm.name not in ("grpo", "dapo", "rloo") or config.rollout.n > 1, "rollout.n",
             f"{config.algorithm.name} compares responses within a group: needs n > 1")
    _require(config.trainer.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    responses = config.trainer.prompts_per_step * config.rollout.n
    _require(responses >= config.actor.ppo_mini_batches, "actor.ppo_mini_batches",
             f"{config.actor.ppo_mini_batches} mini-batches need at least as many responses per step, got {responses}")
    _require(config.actor.role == "actor" and config.ref.role == "ref" and config.critic.role == "critic",
             "actor.role / ref.role / critic.role", "must stay actor, ref and critic")
    model_dir = Path(config.model.path)
    _require((model_dir / "config.json").is_file(), "model.path", f"no HF checkpoint (config.json) at {model_dir}")
    for field, data in (("data.files", config.data), ("val_data.files", config.val_data)):
        if field == "val_data.files" and not config.trainer.val_every:
            continue
        _require(bool(data.files), field, "no dataset files given")
        for file in data.files:
            _require(Path(file).is_file(), field, f"no such file {file}")
    try:
        spec = model_spec_from_hf(str(model_dir))
    except UnsupportedModelError as error:
        raise ConfigError(f"model.path: {error}") from error
    layout_fields = dataclasses.asdict(config.layout)
    try:
        spec.check_layout(ParallelLayout(**layout_fields))
    except LayoutError as error:
        raise ConfigError(f"layout: {error}") from error


def to_yaml(config: RLConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))
