from meshtrain.interop.hf import export_hf
from meshtrain.interop.hf_import import hf_model_args, load_hf_weights

__all__ = ["export_hf", "hf_model_args", "load_hf_weights"]
