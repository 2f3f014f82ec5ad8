from meshtrain.launch.env import LaunchEnv, detect

__all__ = ["LaunchEnv", "detect"]
