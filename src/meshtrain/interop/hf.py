"""Hugging Face interop: export a run or checkpoint as a Hugging Face directory of its family
(Llama, Mistral, Qwen2, Qwen3; config.json in interop/families.py), and start training, serving or
generating from one (`model.init_from = "hf:DIR"`, `serve DIR`).

Names map one to one except for the rotary layout: meshtrain rotates adjacent pairs (x[2i],
x[2i+1]) as in the RoFormer paper and Meta's reference code, Hugging Face rotates halves
(x[i], x[i + d/2]); the q and k projections' output rows (and their biases, and Qwen3's per-head
norms) are permuted per head to match, which moves values without changing them. Padded vocabulary
rows (model.vocab_multiple) are stripped on export and re-added on import. Import reads one tensor
at a time from the safetensors files, and only those this rank keeps: a model under ZeRO-3, TP or
a pipeline never passes through one rank's memory whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import warnings
from pathlib import Path

import torch

from meshtrain.checkpoint import TRAIN_STATE
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, TEMPLATE_FILE
from meshtrain.errors import MeshtrainError
from meshtrain.files import atomic_directory, check_output_dir, mark_output, read_json_object
from meshtrain.interop.families import check_longer_context, config_to_args, export_config
from meshtrain.interop.hf_dir import HFWeights, check_model_directory
from meshtrain.interop.weights import ADAPTER_FILE, peft_record_of, read_weights, run_model_args, run_weights
from meshtrain.model.args import LoraSpec
from meshtrain.model.llama import Llama, ModelArgs, clean_fqn, copy_full_into
from meshtrain.model.lora import ADAPTER_NAMES, apply_lora, merge_state_dict, quantize_base
from meshtrain.model.shapes import Shape

LAYER_NAMES = {
    **{
        f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}"
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
        for kind in ("weight", "bias")
    },
    **{
        f"feed_forward.{ours}.{kind}": f"mlp.{theirs}.{kind}"
        for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        for kind in ("weight", "bias")
    },
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# The files of a Hugging Face directory besides its weights: kept with a run that starts from one
# (<run>/hf_source/), so its export and its server use the model's own tokenizer, end tokens and
# chat template, and its config.json comes back unchanged.
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    TEMPLATE_FILE,
)
SOURCE_DIR = "hf_source"
# written into every directory `meshtrain export` writes (merged or adapters): what marks a directory as
# its own earlier output, which a new export may replace (peft's adapter_config.json is not: any peft run has one)
EXPORT_MARKER = "meshtrain.json"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # meshtrain's names -> config.json's


def pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (of a weight, a bias or a per-head norm) from interleaved pairs to
    rotate-half order."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(rows, *rest)


def halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, -1).transpose(1, 2).reshape(rows, *rest)


def rotary_heads(name: str, args: ModelArgs) -> int | None:
    """How many heads' rows a tensor holds in rotary order (None: no rotary rows)."""
    if ".wq." in name:
        return args.n_heads
    if ".wk." in name:
        return args.n_kv_heads
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 1
    return None


def to_hf_name(name: str) -> str:
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}.{LAYER_NAMES[rest]}"
    return {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }[name]


FROM_HF = {v: k for k, v in LAYER_NAMES.items()}


def from_hf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        return f"layers.{i}.{FROM_HF[rest]}"
    return {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }[name]


# ---------------------------------------------------------------------------------------------
# Export


def load_full_model(source: Path) -> tuple[Llama, ModelArgs, Path]:
    """The full model on the CPU, from a run directory or any checkpoint, whatever layout and world
    size saved it (DCP reads the shards it needs without a process group). A LoRA checkpoint's
    adapters are merged into its base, read from where the run started."""
    ckpt, run_dir = run_weights(Path(source))
    return *_load_model(ckpt, run_dir), run_dir


def _load_model(ckpt: Path | None, run_dir: Path) -> tuple[Llama, ModelArgs]:

    if ckpt is not None:  # verified by run_weights
        train_state = json.loads((ckpt / TRAIN_STATE).read_text())
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


def base_identity(cfg) -> dict:
    """The model a LoRA run's adapters belong to: model.init_from's directory, its config.json's
    SHA-256 and its weights' fingerprint, or the seed of a random initialisation."""
    if not cfg.model.init_from:
        return {"seed": cfg.training.seed}
    directory = Path(cfg.model.init_from.removeprefix("hf:")).resolve()
    return {
        "init_from": str(directory),
        "config_sha256": _config_sha256(directory),
        "weights_sha256": weights_fingerprint(directory),
    }


def _config_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()


FINGERPRINT_BLOCKS = 16  # blocks of 4 KiB read from each weight file's data


def weights_fingerprint(directory: Path) -> str:
    """A SHA-256 of each safetensors file's name, size, header and 16 blocks of 4 KiB spread over its
    data: another model of the same shape (retrained, exported again) differs in nearly every byte,
    so it differs here, without reading gigabytes at each save and resume."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            header = min(int.from_bytes(f.read(8), "little"), size)  # not a safetensors file: its bytes
            digest.update(f.read(header))
            start = 8 + header
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(start + max(size - start, 0) * i // FINGERPRINT_BLOCKS)
                digest.update(f.read(4096))
    return digest.hexdigest()


def check_base(base: dict) -> None:
    """Refuse a LoRA run's Hugging Face base that is gone or is no longer the model its adapters were
    trained on (config.json's checksum or the weights' fingerprint differs; a record without one was
    saved before it was kept): adapters on another base are silently wrong weights."""
    if "init_from" not in base:
        return
    directory = Path(base["init_from"])
    if not (directory / "config.json").is_file():
        raise MeshtrainError(f"the adapters were trained on {directory}, which is gone: put the base model back there")
    for key, what, now in (
        ("config_sha256", "config.json differs", _config_sha256),
        ("weights_sha256", "its weights differ", weights_fingerprint),
    ):
        if base.get(key) not in (None, now(directory)):
            raise MeshtrainError(
                f"the base model at {directory} changed since the adapters were trained on it ({what}): "
                "restore the model the run started from there"
            )


def load_base_model(args: ModelArgs, base: dict) -> Llama:
    """A LoRA run's base on the CPU, as the run started from it."""
    model = Llama(args)
    model.init_weights(base.get("seed", 0))
    check_base(base)
    if "init_from" in base:
        load_hf_weights([model], Path(base["init_from"]), args)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def _merged_lora_checkpoint(ckpt: Path, args: ModelArgs, record: dict) -> Llama:
    spec = LoraSpec.from_dict(record)
    model = load_base_model(args, record["base"])
    apply_lora(model, spec, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(record.get("base_storage")))
    adapters = {k: torch.empty(v.shape) for k, v in model.state_dict().items() if k.endswith(ADAPTER_NAMES)}
    state = {"model": adapters}
    _dcp_load(state, ckpt)
    model.load_state_dict(state["model"], strict=False)
    if spec.quantized:  # the adapters learned against the 4-bit base: merge into what they saw
        quantize_base(model)
    merged, _ = merge_state_dict(model.state_dict(), spec)
    plain = Llama(args)
    plain.load_state_dict(merged, strict=not args.tie_embeddings)
    if args.tie_embeddings:
        plain.output.weight = plain.tok_embeddings.weight
    return plain


def hf_state_dict(model: Llama, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if args.tie_embeddings and name == "output.weight":
            continue
        t = tensor.detach()
        if name in ("tok_embeddings.weight", "output.weight"):
            t = t[: args.vocab_size]  # strip the padding rows
        elif (heads := rotary_heads(name, args)) is not None:
            t = pairs_to_halves(t, heads)
        out[to_hf_name(name)] = t.to(dtype).contiguous().clone()
    return out


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
        args = ModelArgs(**json.loads((ckpt / TRAIN_STATE).read_text())["model"])
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


def keep_source_files(directory: str | Path, run_dir: Path) -> None:
    """Copy a Hugging Face directory's files other than its weights into <run>/hf_source/."""
    from meshtrain.files import copy_file

    for name in SOURCE_FILES:
        if (Path(directory) / name).is_file():
            copy_file(Path(directory) / name, run_dir / SOURCE_DIR / name)


# ---------------------------------------------------------------------------------------------
# Import


def hf_model_args(directory: str | Path, vocab_multiple: int = 64) -> ModelArgs:
    """The shape of a Hugging Face directory's model: the first thing training, serving and generating
    read from it, so a directory transformers would load as another model is refused before any work."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise MeshtrainError(f"model.init_from: {path} does not exist (expected a Hugging Face model directory)")
    check_model_directory(Path(directory))
    return config_to_args(read_json_object(path), f"model.init_from: {path}", vocab_multiple)


def check_context_length(directory: str | Path, max_seq_len: int, length: str = "model.max_seq_len") -> None:
    """A context longer than the directory's config.json gives (`length`: the setting that raised it)
    is refused where transformers would attend within a sliding window past that config's context."""
    path = Path(directory) / "config.json"
    check_longer_context(read_json_object(path), max_seq_len, length, f"model.init_from: {path}")


def load_hf_weights(parts, directory: str | Path, args: ModelArgs) -> None:
    """Copy Hugging Face weights into this rank's (possibly sharded, possibly partial) model, one
    tensor at a time."""
    directory = Path(directory)
    wanted = {clean_fqn(n): p for part in parts for n, p in part.named_parameters() if not n.endswith(ADAPTER_NAMES)}
    with contextlib.ExitStack() as stack, torch.no_grad():
        weights = HFWeights(directory, stack)
        ours_all = {p.name for p in Shape.from_args(args).parameters()} | {"output.weight"}
        unknown = [
            n
            for n in weights.names()
            if _safe(from_hf_name, n) not in ours_all and not n.endswith("rotary_emb.inv_freq")
        ]
        if unknown:
            raise MeshtrainError(
                f"model.init_from: {directory} has weights meshtrain cannot place: {', '.join(unknown[:3])}"
            )
        if args.tie_embeddings and "lm_head.weight" in weights.where:
            if not torch.equal(weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")):
                raise MeshtrainError(
                    f"model.init_from: {directory} ties its embeddings (tie_word_embeddings) but holds an "
                    "lm_head.weight that differs from them: set tie_word_embeddings to false to use both"
                )
        for ours, param in wanted.items():
            name = (
                to_hf_name(ours)
                if not (args.tie_embeddings and ours == "output.weight")
                else "model.embed_tokens.weight"
            )
            if name not in weights.where:
                raise MeshtrainError(f"model.init_from: {directory} has no {name} (needed for {ours})")
            t = weights.get(name)
            if (heads := rotary_heads(ours, args)) is not None and t.shape[0] % (2 * heads) == 0:
                t = halves_to_pairs(t, heads)
            if ours in ("tok_embeddings.weight", "output.weight") and t.shape[0] != args.vocab_size:
                raise MeshtrainError(
                    f"model.init_from: {name} has {t.shape[0]} rows, but config.json's vocab_size is "
                    f"{args.vocab_size}: they must agree (correct vocab_size)"
                )
            if ours in ("tok_embeddings.weight", "output.weight") and t.shape[0] < param.shape[0]:
                full = torch.zeros(param.shape)
                full[: t.shape[0]] = t
                t = full
            if tuple(t.shape) != tuple(param.shape):
                raise MeshtrainError(
                    f"model.init_from: {name} has shape {tuple(t.shape)}, the model needs {tuple(param.shape)}"
                )
            copy_full_into(param, t)
            del t


def _safe(fn, arg):
    try:
        return fn(arg)
    except (KeyError, ValueError):
        return None
