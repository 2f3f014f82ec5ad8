"""What `meshtrain serve` and `meshtrain generate` load: a run directory (its model.safetensors or
latest checkpoint), a checkpoint directory, or a Hugging Face directory (what `meshtrain
export` writes, or a published Llama, Mistral or Qwen), with its tokenizer, end-of-text token and chat template."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, Field, ValidationError

from meshtrain.data.chat import TEMPLATE_FILE, ChatTemplate, template_of
from meshtrain.data.tokenizer import begin_of_text, document_prefix, encode_prompt, load_tokenizer
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
    bos_token: str | None = None  # what the chat template's bos_token renders (tokenizer_config.json's)

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """The tokenizer's special tokens by text (read once: every request's stops look them up)."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def document_prefix(self) -> list[int]:
        return document_prefix(self.tokenizer)

    def prompt_ids(self, text: str, chat: bool) -> list[int]:
        """A prompt's ids as training's data began: a completion's after the special tokens that begin
        each prepared document (Llama 3's <|begin_of_text|>); a rendered chat prompt holds its own, so
        none are added (as transformers' apply_chat_template and `data prepare` tokenize it)."""
        if chat:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return encode_prompt(self.tokenizer, text, self.document_prefix)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt of a chat request: the template the model was trained with, up to the answer.
        It holds its own special tokens (a BOS where the template writes one), as `data prepare`
        rendered the fine-tuning conversations: tokenized without adding any (`prompt_ids`)."""
        return ChatTemplate(self.chat_template, self.eos_token, self.bos_token).render(
            messages, add_generation_prompt=True, tools=tools
        )


def load_served_model(source: str | Path, device: torch.device, dtype: torch.dtype) -> ServedModel:
    from meshtrain.interop.hf import end_tokens, load_full_model
    from meshtrain.interop.hf_dir import PEFT_ADAPTERS
    from meshtrain.interop.hf_import import SOURCE_DIR, hf_model_args, load_hf_weights

    path = Path(source)
    if not path.exists():
        raise MeshtrainError(
            f"{path} does not exist: serve a run directory, a checkpoint or an exported Hugging Face directory"
        )
    if (path / PEFT_ADAPTERS).is_file() and not (path / "config.json").is_file():  # beside one: hf_model_args refuses
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
    tokenizer = load_tokenizer(tokenizer_file)
    # a run that started from a Hugging Face model stops where that model stops
    origin = tokenizer_dir / SOURCE_DIR if (tokenizer_dir / SOURCE_DIR).is_dir() else tokenizer_dir
    eos, eos_ids = end_tokens(origin, tokenizer)
    defaults, ignored = sampling_defaults(origin)
    for note in ignored:
        print(f"warning: {origin}/generation_config.json sets {note}, which serving does not apply", file=sys.stderr)
    model = _cast_keeping_rope(model, device, dtype)
    template = (
        template_of(tokenizer_dir)
        if tokenizer_dir == origin or (tokenizer_dir / TEMPLATE_FILE).is_file()
        else template_of(origin)
    )
    bos = begin_of_text(tokenizer, origin)
    return ServedModel(path.resolve().name, model.eval(), tokenizer, eos_ids, eos, template, defaults, bos)


def _cast_keeping_rope(model: Llama, device: torch.device, dtype: torch.dtype) -> Llama:
    """The model on `device` in `dtype`, its rotary tables still fp32: `.to(dtype=...)` casts every
    float buffer, and bf16 tables (8 bits of mantissa) rotate by other angles than training's fp32
    ones, which no later `.float()` restores. So they are kept aside in fp32 and put back."""
    tables = model.rope_cos.float(), model.rope_sin.float()
    model = model.to(device=device, dtype=dtype)
    model.rope_cos, model.rope_sin = (table.to(device) for table in tables)
    return model


class SamplingDefaults(BaseModel):
    """The sampling a model's generation_config.json may set, with the bounds a request's fields have
    (app.Sampling takes these fields): left out of a request, the model's value applies."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)


def truncations_given(top_p: float | None, top_k: int | None) -> list[str]:
    """Which of top_p and top_k are given at a value that truncates the distribution (not 1, 0 or -1):
    what greedy decoding would leave without effect."""
    return [key for key, value, off in (("top_p", top_p, 1), ("top_k", top_k, 0)) if value not in (None, off, -1)]


class GenerationDefaults(SamplingDefaults):
    """... and the length: max_new_tokens is the default of a request's max_tokens (vLLM's reading),
    up to the room its context leaves; max_length caps prompt + completion where max_new_tokens is not
    set (`default_completion_length`). Not request fields: OpenAI's is max_tokens."""

    max_new_tokens: int | None = Field(None, ge=1)
    max_length: int | None = Field(None, ge=1)


# generation_config.json values the server does not apply, at the value that changes nothing (transformers'
# defaults): any other value is named in a warning at load.
NEUTRAL = {
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_new_tokens": 0,
    "min_length": 0,
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "length_penalty": 1.0,
    "early_stopping": False,
    "num_return_sequences": 1,
    "penalty_alpha": 0.0,
    "guidance_scale": 1.0,
    "token_healing": False,
    "use_mtp": False,
}

# generation_config.json keys that change no generated token whatever their value: token ids (the end
# tokens are read by interop.hf.end_tokens), provenance, caching, compilation, what transformers returns
# besides the tokens, and speculative decoding (which keeps the model's distribution). Any key neither
# applied, nor here, nor in NEUTRAL (forced_eos_token_id, sequence_bias, max_time, dola_layers, ...) is
# named in a warning at load when it is set.
HARMLESS = frozenset(
    {
        "transformers_version",
        "_from_model_config",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "return_legacy_cache",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "continuous_batching_config",
        "low_memory",
        "output_attentions",
        "output_hidden_states",
        "output_logits",
        "output_scores",
        "return_dict_in_generate",
        "renormalize_logits",
        "remove_invalid_values",
        "is_assistant",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_early_exit",
        "assistant_lookbehind",
        "target_lookbehind",
        "prompt_lookup_num_tokens",
        "max_matching_ngram_size",
        "speculation_type",
    }
)


def sampling_defaults(directory: Path) -> tuple[dict[str, float], list[str]]:
    """generation_config.json's temperature, top_p, top_k, max_new_tokens and max_length: what the
    model's authors sample it with, the server's defaults where a request leaves them out (as vLLM and
    transformers take them; Llama 3 instruct: 0.6 and 0.9); `do_sample: false` makes greedy
    (temperature 0) the default, as transformers decodes such a model (and as meshtrain's export of a
    fresh run says), while its top_p and top_k stay the defaults of a request that asks for sampling
    with a temperature (as transformers and vLLM keep them). Returns them and a note for each value
    the server does not apply (`unapplied`). A value a request could not send is refused in one line."""
    path = directory / "generation_config.json"
    config = read_json_object(path)
    defaults = {key: config[key] for key in GenerationDefaults.model_fields if config.get(key) is not None}
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise MeshtrainError(f"{path}: do_sample = {do_sample!r}: it should be true or false; correct or remove it")
    notes = unapplied(config)
    if do_sample is False:  # greedy by default, as transformers decodes it; its temperature is then unused
        defaults["temperature"] = 0.0
        for key in ("top_p", "top_k"):  # unused by greedy decoding: one out of range is dropped, not refused
            try:
                GenerationDefaults.model_validate({key: defaults[key]}, strict=True) if key in defaults else None
            except ValidationError:
                notes.append(f"{key} = {json.dumps(defaults.pop(key))} (out of range; do_sample is false)")
    try:
        GenerationDefaults.model_validate(defaults, strict=True)
    except ValidationError as e:
        error = e.errors()[0]
        raise MeshtrainError(
            f"{path}: {error['loc'][0]} = {error['input']!r}: {error['msg'][0].lower()}{error['msg'][1:]}; correct or "
            "remove it"
        ) from None
    return defaults, notes


def unapplied(config: dict) -> list[str]:
    """`key = value` for each generation_config.json value that would change the generated tokens but
    the server does not apply: neither applied (GenerationDefaults), nor HARMLESS, nor unset (null or
    empty) or at its NEUTRAL value. Named at load rather than dropped without a word."""
    notes = []
    for key, value in config.items():
        applied = key in GenerationDefaults.model_fields or key == "do_sample"
        if applied or key in HARMLESS or value in (None, [], {}) or (key in NEUTRAL and value == NEUTRAL[key]):
            continue
        text = json.dumps(value)
        notes.append(f"{key} = {text if len(text) <= 60 else text[:57] + '...'}")
    return notes


def default_completion_length(defaults: dict, prompt_tokens: int, room: int, fallback: int) -> int:
    """The completion length of a request that gives no max_tokens, at least 1: generation_config.json's
    max_new_tokens where set, else `fallback` (OpenAI's default) capped by its max_length, which counts
    the prompt too (Llama 2 ships 4096); a prompt already that long gets 1 token, as transformers
    generates it. max_new_tokens wins over max_length, as in transformers (vLLM reads max_new_tokens
    only). Either way up to the `room` the context leaves. A request's own max_tokens is never capped by
    max_length, only by the context: the request says how long (OpenAI's semantics)."""
    if "max_new_tokens" in defaults:
        length = defaults["max_new_tokens"]
    else:
        length = min(fallback, defaults.get("max_length", prompt_tokens + fallback) - prompt_tokens)
    return max(1, min(length, room))
