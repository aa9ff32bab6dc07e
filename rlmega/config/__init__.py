"""The typed configuration of an RL run, loaded from YAML and Hydra-style overrides, validated once."""

from rlmega.config.load import CONFIG_DIR, ConfigError, load_config, validate
from rlmega.config.schema import RLConfig

__all__ = ["CONFIG_DIR", "ConfigError", "RLConfig", "load_config", "validate"]
