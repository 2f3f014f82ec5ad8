"""User-facing errors: the CLI prints these as one line, without a traceback."""


class MeshtrainError(Exception):
    """A problem with the user's input (config, data, checkpoint, environment) that they can fix."""


class ConfigError(MeshtrainError):
    pass


class DataError(MeshtrainError):
    pass


class CheckpointError(MeshtrainError):
    pass
