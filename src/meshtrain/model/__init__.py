from meshtrain.model.llama import Llama, ModelArgs, flops_per_token, num_params
from meshtrain.model.presets import PRESETS

__all__ = ["Llama", "ModelArgs", "PRESETS", "flops_per_token", "num_params"]
