"""The run configuration: one dataclass per section (``sections``), a value applied from the
command line (``overrides``), the typed sampling configuration (``sampling``), loading with
precedence and the resolved TOML writer (``load``), and the shipped recipes (``recipes/``).

Torch-free: preflight imports it before anything heavy loads. The names below are the
package's public surface; everything else is imported from its own module.
"""
from trainer.config.load import (RECIPES_DIR, dump_toml, field_help, load_config,  # noqa: F401
                                 resolve_recipe, write_resolved)
from trainer.config.sections import (DEFAULT_SAMPLING, CheckpointConfig, Config,  # noqa: F401
                                     ConfigError, DataConfig, EMAConfig, FSDPConfig, LaunchConfig,
                                     LoggingConfig, LoRAConfig, ModelConfig, RewardConfig,
                                     RolloutConfig, TrainConfig, WeightSyncConfig, cli_flag,
                                     flag_table)
