from meshtrain.model.llama import Llama, ModelArgs, num_params
from meshtrain.model.presets import PRESETS

__all__ = ["Llama", "ModelArgs", "PRESETS", "num_params"]
