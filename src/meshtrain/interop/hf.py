"""Hugging Face export: a run or checkpoint written as a Hugging Face directory of its family
(Llama, Mistral, Qwen2, Qwen3; config.json in interop/families.py), merged or as peft adapters,
with its tokenizer, chat template and end tokens; and a run's model loaded whole for it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import torch

from meshtrain.checkpoint import read_train_state
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, TEMPLATE_FILE
from meshtrain.errors import MeshtrainError
from meshtrain.files import atomic_directory, check_output_dir, mark_output, read_json_object
from meshtrain.interop.base import check_base, merged_onto_base
from meshtrain.interop.families import export_config
from meshtrain.interop.hf_import import SOURCE_DIR, SOURCE_FILES
from meshtrain.interop.hf_names import (
    SHORT_DTYPES,
    TORCH_DTYPES,
    hf_state_dict,
    pairs_to_halves,
    rotary_heads,
    to_hf_name,
)
from meshtrain.interop.weights import ADAPTER_FILE, peft_record_of, read_weights, run_model_args, run_weights
from meshtrain.model.args import LoraSpec
from meshtrain.model.llama import Llama, ModelArgs
from meshtrain.model.lora import ADAPTER_NAMES, apply_lora

# written into every directory `meshtrain export` writes (merged or adapters): what marks a directory as
# its own earlier output, which a new export may replace (peft's adapter_config.json is not: any peft run has one)
EXPORT_MARKER = "meshtrain.json"


def load_full_model(source: Path) -> tuple[Llama, ModelArgs, Path]:
    """The full model on the CPU, from a run directory or any checkpoint, whatever layout and world
    size saved it (DCP reads the shards it needs without a process group). A LoRA checkpoint's
    adapters are merged into its base, read from where the run started."""
    ckpt, run_dir = run_weights(Path(source))
    return *_load_model(ckpt, run_dir), run_dir


def _load_model(ckpt: Path | None, run_dir: Path) -> tuple[Llama, ModelArgs]:

    if ckpt is not None:  # verified by run_weights
        train_state = read_train_state(ckpt)
        args = ModelArgs(**train_state["model"])
        if train_state.get("peft"):
            return _merged_lora_checkpoint(ckpt, args, train_state["peft"]), args
    else:
        args = run_model_args(run_dir / "model.json")
    model = Llama(args)
    model.init_weights(0)
    if ckpt is not None:
        state = {"model": model.state_dict()}
        _dcp_load(state, ckpt)
        model.load_state_dict(state["model"])
    else:
        model.load_full_state(read_weights(run_dir / "model.safetensors"))
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model, args


def _dcp_load(state: dict, ckpt: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)


def _merged_lora_checkpoint(ckpt: Path, args: ModelArgs, record: dict) -> Llama:
    """A LoRA checkpoint's model: its adapters and buffers (the frozen base is not in it) merged
    into the base, read again from where the run started (merged_onto_base)."""
    with torch.device("meta"):  # the names and shapes of what the checkpoint holds
        adapted = Llama(args)
        apply_lora(adapted, LoraSpec.from_dict(record))
    frozen = {name for name, p in adapted.named_parameters() if not name.endswith(ADAPTER_NAMES)}
    state = {"model": {k: torch.empty(v.shape) for k, v in adapted.state_dict().items() if k not in frozen}}
    _dcp_load(state, ckpt)
    plain = Llama(args)
    plain.load_state_dict(merged_onto_base(state["model"], args, record), strict=not args.tie_embeddings)
    if args.tie_embeddings:
        plain.output.weight = plain.tok_embeddings.weight
    return plain


def end_tokens(directory: Path, tokenizer) -> tuple[str | None, list[int]]:
    """A model's end-of-text token (what a chat template's eos_token renders) and every id that ends a
    generation: generation_config.json's and config.json's eos_token_id (an id or a list: Llama 3's
    instruct models end a turn with <|eot_id|>, a text with <|end_of_text|>), tokenizer_config.json's
    eos_token, else the tokenizer's own end-of-text token."""
    from meshtrain.data.tokenizer import end_of_text

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = read_json_object(directory / name).get("eos_token_id")
        ids += [value] if isinstance(value, int) else [i for i in value or [] if isinstance(i, int)]
    token, token_id = end_of_text(tokenizer, directory)
    if token_id is not None:
        ids.append(token_id)
    return token, list(dict.fromkeys(ids))


def export_hf(source: str | Path, out: str | Path, max_shard_size: str = "5GB", dtype: str = "auto") -> Path:
    """Write a Hugging Face directory of the model's family: config.json, safetensors shards (+ index
    when split), generation_config.json, tokenizer files. A run that started from a Hugging Face
    directory gets that model's own config (where the shape is unchanged), tokenizer files, chat
    template and, with dtype auto, its dtype; otherwise fp32 and meshtrain's tokenizer config.
    Written to a temporary directory, then renamed."""
    from huggingface_hub import save_torch_state_dict
    from transformers import PreTrainedTokenizerFast

    from meshtrain.data.tokenizer import begin_of_text, load_tokenizer

    check_output_dir(out, [source], EXPORT_MARKER, "meshtrain export")  # before reading the source
    ckpt, run_dir = run_weights(Path(source))
    check_output_dir(out, _lora_base(ckpt, run_dir), EXPORT_MARKER, "meshtrain export")
    model, args = _load_model(ckpt, run_dir)
    tokenizer_file = run_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise MeshtrainError(f"{tokenizer_file} is missing: the export needs the run's tokenizer")
    origin = run_dir / SOURCE_DIR
    source_config = read_json_object(origin / "config.json") or None
    if dtype == "auto":
        dtype = (source_config or {}).get("torch_dtype") or (source_config or {}).get("dtype") or "float32"
    dtype = SHORT_DTYPES.get(dtype, dtype)
    if dtype not in TORCH_DTYPES:
        raise MeshtrainError(f"export dtype {dtype!r}: use auto, {', '.join(SHORT_DTYPES)}")
    tokenizer = load_tokenizer(tokenizer_file)
    eos, eos_ids = end_tokens(origin if origin.is_dir() else run_dir, tokenizer)
    # what the run's chat template rendered as bos_token in training (data prepare) and renders in `serve`: its
    # tokenizer_config.json's BOS, else none (''); config.json's bos_token_id falls back to the EOS, GPT-2's use
    bos = begin_of_text(tokenizer, run_dir)
    bos_id_token = bos or eos
    bos_id = (source_config or {}).get("bos_token_id", tokenizer.token_to_id(bos_id_token) if bos_id_token else None)

    out = Path(out)
    with atomic_directory(out) as tmp:
        save_torch_state_dict(hf_state_dict(model, args, TORCH_DTYPES[dtype]), tmp, max_shard_size=max_shard_size)
        config = export_config(args, source_config, dtype, bos_id, eos_ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        template = run_dir / TEMPLATE_FILE  # what the run was fine-tuned with
        source_tokenizer = (origin / "tokenizer.json").is_file()
        if origin.is_dir():  # its tokenizer's files (and template) only with its tokenizer, which the run trained on
            for name in SOURCE_FILES[1:] if source_tokenizer else ["generation_config.json"]:
                if (origin / name).is_file():
                    shutil.copyfile(origin / name, tmp / name)
        else:
            generation = {"bos_token_id": bos_id, "eos_token_id": config["eos_token_id"], "do_sample": False}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if source_tokenizer:
            if template.is_file():
                shutil.copyfile(template, tmp / TEMPLATE_FILE)
        else:  # the run's own tokenizer: a fresh run's, or the data's where the source directory had none
            PreTrainedTokenizerFast(
                tokenizer_file=str(tokenizer_file),
                eos_token=eos,
                bos_token=bos,
                chat_template=template.read_text() if template.is_file() else DEFAULT_CHAT_TEMPLATE,
            ).save_pretrained(tmp)
        mark_output(tmp, EXPORT_MARKER, {"model": dataclasses.asdict(args)})
    return out


def _lora_base(ckpt: Path | None, run_dir: Path) -> list[Path]:
    """The Hugging Face directory a LoRA run's adapters belong to, which an export must not replace."""
    base = (peft_record_of(ckpt, run_dir) or {}).get("base", {})
    return [Path(base["init_from"])] if "init_from" in base else []


def export_adapter(source: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """A LoRA run's adapters in the peft format (adapter_config.json + adapter_model.safetensors),
    which `peft.PeftModel.from_pretrained` loads onto the Hugging Face model the run started from.
    From the run's adapter.safetensors, or the adapters of any of its checkpoints."""
    from safetensors.torch import save_file

    from meshtrain.model.args import HF_NAMES

    check_output_dir(out, [source], EXPORT_MARKER, "meshtrain export --adapter")  # before reading the source
    ckpt, run_dir = run_weights(Path(source))
    check_output_dir(out, _lora_base(ckpt, run_dir), EXPORT_MARKER, "meshtrain export --adapter")
    record = peft_record_of(ckpt, run_dir)
    if ckpt is not None:
        args = ModelArgs(**read_train_state(ckpt)["model"])
    else:
        args = run_model_args(run_dir / "model.json")
    if not record:
        raise MeshtrainError(f"{source} was trained without adapters (peft.method none): export it without --adapter")
    if "init_from" not in record["base"]:
        raise MeshtrainError(
            f"the adapters of {source} belong to a randomly initialised base, not a Hugging Face model peft could "
            "load them onto: export the merged model (without --adapter)"
        )
    check_base(record["base"])  # peft would load the adapters onto whatever is there now
    spec = LoraSpec.from_dict(record)
    if ckpt is not None:
        model = Llama(args)
        apply_lora(model, spec)
        state = {"model": {k: v for k, v in model.state_dict().items() if k.endswith(ADAPTER_NAMES)}}
        _dcp_load(state, ckpt)
        adapters = state["model"]
    else:
        adapters = read_weights(run_dir / ADAPTER_FILE)
    dtype = SHORT_DTYPES.get(dtype, "float32" if dtype == "auto" else dtype)
    tensors = {}
    for name, t in adapters.items():
        layer, kind = name.rsplit(".", 1)  # layers.0.attention.wq, lora_a
        if kind == "lora_b" and (heads := rotary_heads(name, args)) is not None:
            t = pairs_to_halves(t, heads)  # B's rows are the projection's output rows
        hf_layer = to_hf_name(f"{layer}.weight").removesuffix(".weight")
        tensors[f"base_model.model.{hf_layer}.lora_{kind[-1].upper()}.weight"] = t.to(TORCH_DTYPES[dtype]).contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": record["base"]["init_from"],
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": [HF_NAMES[name] for name in spec.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    out = Path(out)
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        mark_output(tmp, EXPORT_MARKER, {"adapter_of": record["base"]})
    return out
