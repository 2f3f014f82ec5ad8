"""User-facing errors: the CLI prints these as one line, without a traceback."""


class MeshtrainError(Exception):
    """A problem with the user's input (config, data, checkpoint, environment) that they can fix."""


class ConfigError(MeshtrainError):
    """An invalid config value or layout, reported before any process group starts."""


class DataError(MeshtrainError):
    """Missing, empty, corrupt or mis-encoded training data."""


class CheckpointError(MeshtrainError):
    """A missing, partial, corrupt or mismatched checkpoint."""
