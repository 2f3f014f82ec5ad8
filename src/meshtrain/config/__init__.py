"""One typed config tree: the schema (documented, declared dataclasses), reading (TOML + dotted
overrides) and checks. Every failure is one line naming the key, the value and what is allowed."""

from meshtrain.config.checks import SHAPED_BY, check_keys_in_force
from meshtrain.config.grammar import parse_data_path, parse_duration, parse_size
from meshtrain.config.loading import load_config, parse_overrides, set_dotted, set_value
from meshtrain.config.options import Declared, declared, field_docs, option
from meshtrain.config.schema import (
    DEVICES,
    LAUNCHERS,
    LOG_LEVELS,
    PP_SCHEDULES,
    SECTIONS,
    SINGLE_STAGE_SCHEDULES,
    CheckpointConfig,
    Config,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    config_keys,
    resolved,
    section_of,
    to_toml,
)

__all__ = [
    "DEVICES",
    "LAUNCHERS",
    "LOG_LEVELS",
    "PP_SCHEDULES",
    "SECTIONS",
    "SINGLE_STAGE_SCHEDULES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "Declared",
    "LaunchConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainingConfig",
    "SHAPED_BY",
    "check_keys_in_force",
    "config_keys",
    "declared",
    "field_docs",
    "load_config",
    "option",
    "parse_data_path",
    "parse_duration",
    "parse_overrides",
    "parse_size",
    "resolved",
    "section_of",
    "set_dotted",
    "set_value",
    "to_toml",
]
