"""Hugging Face interop: export a run or checkpoint as a `LlamaForCausalLM` directory, and start
training from one (`model.init_from = "hf:DIR"`).

Names map one to one except for the rotary layout: meshtrain rotates adjacent pairs (x[2i],
x[2i+1]) as in the RoFormer paper and Meta's reference code, Hugging Face rotates halves
(x[i], x[i + d/2]); the q and k projections' output rows are permuted per head to match. Padded
vocabulary rows (model.vocab_multiple) are stripped on export and re-added on import.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from meshtrain.checkpoint import MARKER, TRAIN_STATE, committed_checkpoints, verify
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, TEMPLATE_FILE
from meshtrain.errors import MeshtrainError
from meshtrain.files import atomic_directory, check_output_dir
from meshtrain.model.llama import Llama, ModelArgs, clean_fqn, copy_full_into

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs to rotate-half order."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


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


def _resolve_source(source: Path) -> tuple[Path | None, Path]:
    """(checkpoint dir or None for the run's model.safetensors, run dir)."""
    if (source / MARKER).is_file() or (source / ".metadata").is_file():
        return source, source.parent.parent
    ckpts = committed_checkpoints(source / "checkpoints")
    if ckpts:
        return ckpts[-1], source
    if (source / "model.safetensors").is_file():
        return None, source
    raise MeshtrainError(
        f"{source} holds neither a committed checkpoint nor model.safetensors: pass a run "
        "directory or a checkpoints/step_N directory"
    )


def load_full_model(source: Path) -> tuple[Llama, ModelArgs, Path]:
    """The full model on the CPU, from a run directory or any checkpoint, whatever layout and world
    size saved it (DCP reads the shards it needs without a process group)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ckpt, run_dir = _resolve_source(Path(source))
    if ckpt is not None:
        verify(ckpt)
        args = ModelArgs(**json.loads((ckpt / TRAIN_STATE).read_text())["model"])
    else:
        args = ModelArgs(**json.loads((run_dir / "model.json").read_text()))
    model = Llama(args)
    model.init_weights(0)
    if ckpt is not None:
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(load_file(run_dir / "model.safetensors"), strict=not args.tie_embeddings)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model, args, run_dir


def hf_state_dict(model: Llama, args: ModelArgs) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if args.tie_embeddings and name == "output.weight":
            continue
        t = tensor.detach()
        if name in ("tok_embeddings.weight", "output.weight"):
            t = t[: args.vocab_size]  # strip the padding rows
        elif name.endswith("wq.weight"):
            t = pairs_to_halves(t, args.n_heads)
        elif name.endswith("wk.weight"):
            t = pairs_to_halves(t, args.n_kv_heads)
        out[to_hf_name(name)] = t.contiguous().clone()
    return out


def hf_config(args: ModelArgs, eos_id: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def export_hf(source: str | Path, out: str | Path, max_shard_size: str = "5GB") -> Path:
    """Write a Hugging Face Llama directory: config.json, safetensors shards (+ index when split),
    generation_config.json, tokenizer files. Written to a temporary directory, then renamed."""
    from huggingface_hub import save_torch_state_dict
    from transformers import PreTrainedTokenizerFast

    check_output_dir(out, [source], "meshtrain.json", "meshtrain export")
    model, args, run_dir = load_full_model(Path(source))
    tokenizer_file = run_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise MeshtrainError(f"{tokenizer_file} is missing: the export needs the run's tokenizer")
    from tokenizers import Tokenizer

    from meshtrain.data.tokenizer import end_of_text

    eos, eos_id = end_of_text(Tokenizer.from_file(str(tokenizer_file)))

    out = Path(out)
    with atomic_directory(out) as tmp:
        save_torch_state_dict(hf_state_dict(model, args), tmp, max_shard_size=max_shard_size)
        (tmp / "config.json").write_text(json.dumps(hf_config(args, eos_id), indent=2))
        generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        template = run_dir / TEMPLATE_FILE  # what the run was fine-tuned with
        PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_file),
            eos_token=eos,
            bos_token=eos,
            chat_template=template.read_text() if template.is_file() else DEFAULT_CHAT_TEMPLATE,
        ).save_pretrained(tmp)
        (tmp / "meshtrain.json").write_text(json.dumps({"model": dataclasses.asdict(args)}, indent=2))
    return out


# ---------------------------------------------------------------------------------------------
# Import


def hf_model_args(directory: str | Path, vocab_multiple: int = 64) -> ModelArgs:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise MeshtrainError(f"model.init_from: {path} does not exist (expected a Hugging Face Llama directory)")
    c = json.loads(path.read_text())
    if c.get("model_type") != "llama":
        raise MeshtrainError(f"model.init_from: {path} is a {c.get('model_type')!r} model, not 'llama'")
    rope = c.get("rope_parameters") or {}
    return ModelArgs(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        ffn_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c.get("max_position_embeddings", 2048),
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_embeddings=c.get("tie_word_embeddings", False),
        vocab_multiple=vocab_multiple,
    )


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    state = {}
    for name in files:
        if not (directory / name).is_file():
            raise MeshtrainError(f"model.init_from: {directory / name} is missing")
        state.update(load_file(directory / name))
    return state


def load_hf_weights(parts, directory: str | Path, args: ModelArgs) -> None:
    """Copy Hugging Face weights into this rank's (possibly sharded, possibly partial) model."""
    directory = Path(directory)
    hf = read_hf_weights(directory)
    wanted = {clean_fqn(n): p for part in parts for n, p in part.named_parameters()}
    unknown = [n for n in hf if _safe(from_hf_name, n) is None and not n.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise MeshtrainError(
            f"model.init_from: {directory} has weights meshtrain cannot place: {', '.join(unknown[:3])}"
        )
    with torch.no_grad():
        for ours, param in wanted.items():
            name = (
                to_hf_name(ours)
                if not (args.tie_embeddings and ours == "output.weight")
                else "model.embed_tokens.weight"
            )
            if name not in hf:
                raise MeshtrainError(f"model.init_from: {directory} has no {name} (needed for {ours})")
            t = hf[name].float()
            if ours.endswith("wq.weight"):
                t = halves_to_pairs(t, args.n_heads)
            elif ours.endswith("wk.weight"):
                t = halves_to_pairs(t, args.n_kv_heads)
            if ours in ("tok_embeddings.weight", "output.weight"):
                full = torch.zeros(param.shape)
                full[: t.shape[0]] = t
                t = full
            if tuple(t.shape) != tuple(param.shape):
                raise MeshtrainError(
                    f"model.init_from: {name} has shape {tuple(t.shape)}, the model needs {tuple(param.shape)}"
                )
            copy_full_into(param, t)


def _safe(fn, arg):
    try:
        return fn(arg)
    except (KeyError, ValueError):
        return None
