"""One typed config tree: the schema (documented dataclasses), reading (TOML + dotted overrides) and
value checks. Every failure is one line naming the key, the value and what is allowed."""

from meshtrain.config.checks import check_model_args, parse_data_path, parse_duration, parse_size, validate
from meshtrain.config.loading import describe_type, load_config, parse_overrides, set_dotted, set_value
from meshtrain.config.schema import (
    LAUNCHERS,
    LOG_LEVELS,
    PP_SCHEDULES,
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
    field_docs,
    micro_batches,
    resolved,
    to_toml,
)

__all__ = [
    "LAUNCHERS",
    "LOG_LEVELS",
    "PP_SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainingConfig",
    "check_model_args",
    "parse_data_path",
    "config_keys",
    "describe_type",
    "field_docs",
    "load_config",
    "micro_batches",
    "parse_duration",
    "parse_overrides",
    "parse_size",
    "resolved",
    "set_dotted",
    "set_value",
    "to_toml",
    "validate",
]
