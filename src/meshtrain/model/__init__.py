"""The model: its shape (args, presets: plain values) and the network (llama: torch, imported when
first asked for, so that reading a config does not load the framework)."""

from meshtrain.model.args import ModelArgs
from meshtrain.model.presets import PRESETS

__all__ = ["Llama", "ModelArgs", "PRESETS", "num_params"]


def __getattr__(name: str):
    if name in ("Llama", "num_params"):
        from meshtrain.model import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'meshtrain.model' has no attribute {name!r}")
