"""Who am I (env), how processes start (local, jobscript) and join (distributed)."""

from meshtrain.launch.env import LaunchEnv, detect

__all__ = ["LaunchEnv", "detect"]
