"""What `meshtrain serve` and `meshtrain generate` load: a run directory (its model.safetensors or
latest checkpoint), a checkpoint directory, or a Hugging Face directory (what `meshtrain
export` writes, or a published Llama, Mistral or Qwen), with its tokenizer, end-of-text token and chat template."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshtrain.data.chat import TEMPLATE_FILE, ChatTemplate, template_of
from meshtrain.errors import MeshtrainError
from meshtrain.files import read_json_object
from meshtrain.model import Llama


@dataclass
class ServedModel:
    name: str
    model: Llama
    tokenizer: object  # tokenizers.Tokenizer
    eos_ids: list[int]  # every token that ends a generation
    eos_token: str | None
    chat_template: str
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # generation_config.json's

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special tokens by text (read once: every request's stops look them up)."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt of a chat request: the template the model was trained with, up to the answer."""
        return ChatTemplate(self.chat_template, self.eos_token).render(messages, add_generation_prompt=True)


def load_served_model(source: str | Path, device: torch.device, dtype: torch.dtype) -> ServedModel:
    from tokenizers import Tokenizer

    from meshtrain.interop.hf import (
        SOURCE_DIR,
        end_tokens,
        hf_model_args,
        load_full_model,
        load_hf_weights,
    )

    path = Path(source)
    if not path.exists():
        raise MeshtrainError(
            f"{path} does not exist: serve a run directory, a checkpoint or an exported Hugging Face directory"
        )
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise MeshtrainError(
            f"{path} holds LoRA adapters alone (peft's format): serve the run they came from, or its merged "
            "export (`meshtrain export RUN --out DIR`)"
        )
    if (path / "config.json").is_file():  # a Hugging Face directory
        args = hf_model_args(path)
        model = Llama(args)
        model.init_weights(0)
        load_hf_weights([model], path, args)
        tokenizer_dir = path
    else:
        model, args, tokenizer_dir = load_full_model(path)
    tokenizer_file = tokenizer_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise MeshtrainError(f"{tokenizer_file} is missing: the server needs the model's tokenizer")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    # a run that started from a Hugging Face model stops where that model stops
    origin = tokenizer_dir / SOURCE_DIR if (tokenizer_dir / SOURCE_DIR).is_dir() else tokenizer_dir
    eos, eos_ids = end_tokens(origin, tokenizer)
    defaults, ignored = sampling_defaults(origin)
    for note in ignored:
        print(f"warning: {origin}/generation_config.json sets {note}, which serving does not apply", file=sys.stderr)
    model = model.to(device=device, dtype=dtype)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    template = (
        template_of(tokenizer_dir)
        if tokenizer_dir == origin or (tokenizer_dir / TEMPLATE_FILE).is_file()
        else template_of(origin)
    )
    return ServedModel(path.resolve().name, model.eval(), tokenizer, eos_ids, eos, template, defaults)


SAMPLING_DEFAULTS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, None)}  # key -> bounds
NEUTRAL = {"repetition_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0, "no_repeat_ngram_size": 0}  # not applied


def sampling_defaults(directory: Path) -> tuple[dict[str, float], list[str]]:
    """generation_config.json's temperature, top_p and top_k: what the model's authors sample it with,
    the server's defaults where a request leaves them out (as vLLM and transformers take them; Llama
    3 instruct: 0.6 and 0.9). Returns them and a note for each sampling value the server does not
    apply (repetition_penalty, min_p, ...). A value out of range is refused in one line."""
    config = read_json_object(directory / "generation_config.json")
    defaults = {}
    for key, (low, high) in SAMPLING_DEFAULTS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (high and value > high):
            raise MeshtrainError(
                f"{directory / 'generation_config.json'}: {key} = {value!r} is not a number between {low} and "
                f"{high or 'any'}: correct or remove it"
            )
        defaults[key] = value
    if defaults.get("top_p") == 0:
        raise MeshtrainError(f"{directory / 'generation_config.json'}: top_p = 0 keeps no token: correct or remove it")
    ignored = [f"{key} = {config[key]}" for key, neutral in NEUTRAL.items() if config.get(key) not in (None, neutral)]
    return defaults, ignored
