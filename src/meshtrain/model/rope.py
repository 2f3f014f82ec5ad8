"""Rotary frequencies and their long-context rescalings, one function a scheme, in the parameter
names Hugging Face's `rope_parameters` use (so an imported config's dict is read as it is):

- "default": theta^(-2i/d) (RoFormer);
- "linear": every frequency divided by `factor` (position interpolation, Chen et al. 2023);
- "llama3": low frequencies divided by `factor`, high ones kept, a smooth ramp between (Llama 3.1);
- "yarn": per-frequency blend of interpolation and extrapolation, plus an attention temperature
  applied to cos/sin (Peng et al. 2023; Qwen 2.5/3's long-context setting).

Schemes that change with the sequence at run time (dynamic NTK, LongRoPE) are refused on import.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(frequency of each rotated pair (head_dim / 2,) in float64, factor applied to cos and sin)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return freqs, 1.0
    if kind == "linear":
        return freqs / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(freqs, scaling), 1.0
    if kind == "yarn":
        return _yarn(freqs, head_dim, theta, scaling)
    raise ValueError(f"rope_type {kind!r} is not one of {', '.join(ROPE_TYPES)}")


def _llama3(freqs: torch.Tensor, s: dict) -> torch.Tensor:
    """Wavelengths longer than original/low_freq_factor are stretched by `factor`, shorter than
    original/high_freq_factor kept, and the band between interpolated."""
    factor, low, high, original = (
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > original / low, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def _yarn(freqs: torch.Tensor, head_dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than beta_slow times over the original context are
    interpolated, more than beta_fast times extrapolated, a linear ramp between; cos/sin are scaled
    by 0.1 ln(factor) + 1 (or the config's attention_factor / mscale ratio)."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a single-dimension ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return freqs / factor * (1 - extrapolated) + freqs * extrapolated, float(attention_factor)
