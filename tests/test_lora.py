"""LoRA and QLoRA: adapters on a frozen base, the same on every layout, checkpointed alone, exported
merged or in the peft format that the peft library loads onto the base model."""

import json
import re

import pytest
import torch
from hf_families import make_model, probe_tokens
from safetensors.torch import load_file

from conftest import assert_same_run, assert_user_error, read_metrics, run_cli, train_args, train_together
from meshtrain.config import load_config
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.job import resolve
from meshtrain.job.model import adapters_of
from meshtrain.model.args import parse_targets
from meshtrain.model.lora import merge_state_dict
from meshtrain.parallel.memory import model_state_bytes
from meshtrain.train.build import build as build_state

QLORA = {"method": "qlora"}
ODD_MODEL = {"dim": 36, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 36}  # 36 x 36 weights: not blocks of 64
LORA = ("--peft.method", "lora", "--peft.rank", "4", "--training.lr", "1e-2")


def test_targets_take_our_names_or_hugging_faces():
    assert parse_targets("all") == ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
    assert parse_targets("q_proj, v_proj") == ("wq", "wv")
    assert parse_targets("mlp") == ("w1", "w2", "w3")
    with pytest.raises(ValueError, match="lm_head is not a linear"):
        parse_targets("wq,lm_head")


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({"peft": {"rank": 16}}, 1, "peft.rank sets the adapters, but peft.method is none"),
        ({"peft": {"method": "lora", "targets": "wq,bogus"}}, 1, "bogus is not a linear"),
        ({"training": {"dpo_beta": 0.2}}, 1, "training.dpo_beta is DPO's"),
        ({"training": {"objective": "dpo", "document_masking": False}}, 1, "one conversation a row"),
        ({"peft": {"method": "qlora"}}, 1, "set training.dtype = bf16"),
        ({"peft": QLORA, "training": {"dtype": "bf16"}, "parallel": {"zero": 3}}, 2, "one process or plain DDP"),
        ({"peft": QLORA, "training": {"dtype": "bf16"}, "parallel": {"tp": 2}}, 2, "one process or plain DDP"),
        ({"peft": QLORA, "training": {"dtype": "bf16"}, "model": ODD_MODEL}, 1, "(36, 36) does not divide"),
        (
            {"peft": {"method": "lora"}, "training": {"objective": "dpo"}, "parallel": {"pp": 2}},
            2,
            "not implemented for pipelines",
        ),
    ],
)
def test_peft_and_objective_keys_take_effect_or_are_refused(overrides, world, message):
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        cfg = load_config(None, dotted(overrides))
        resolve(cfg, world)


def dotted(sections: dict) -> dict:
    return {f"{section}.{key}": value for section, keys in sections.items() for key, value in keys.items()}


def test_the_optimizer_holds_the_adapters_only():
    """The default model with LoRA on every linear: the optimizer's states are a few percent of the
    parameters' bytes, the base is frozen, and B starts at zero (the model starts as the base)."""
    cfg = load_config(None, {"peft.method": "lora", "run.dir": "unused", "training.dtype": "fp32"})
    s = build_state(cfg, with_data=False)
    part = s.model.parts[0]
    used = model_state_bytes(list(part.parameters()), s.optimizer)
    trainable = [n for n, p in part.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    assert len(trainable) == 2 * 7 * s.args.n_layers
    # states exist after a step
    tokens = torch.randint(0, s.args.vocab_size, (2, 33))
    s.step(tokens[:, :-1], tokens[:, 1:])
    used = model_state_bytes(list(part.parameters()), s.optimizer)
    assert 0 < used["optimizer"] <= 0.10 * used["params"], used
    assert used["grads"] * 2 == used["optimizer"]


@pytest.mark.multiproc
def test_lora_loss_is_the_same_on_one_process_zero3_and_tp2_and_resumes_exactly(corpus, cli_env, tmp_path):
    runs = {name: tmp_path / name for name in ("single", "zero3", "tp2")}
    result = run_cli(train_args(corpus, runs["single"], *LORA, "--checkpoint.every", "5"), cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    two_process = {"zero3": ("--parallel.zero", "3"), "tp2": ("--parallel.tp", "2")}  # one launch for both
    args = [train_args(corpus, runs[n], *LORA, "--checkpoint.every", "5", *extra) for n, extra in two_process.items()]
    train_together(args, 2, cli_env)
    for name in ("zero3", "tp2"):
        assert_same_run(runs[name], runs["single"])
    losses = [r["loss"] for r in read_metrics(runs["single"])]
    assert losses[-1] < losses[0] - 0.05  # the adapters learn

    # the checkpoint holds the adapters and names the base; the run holds them merged and alone
    state = json.loads((runs["single"] / "checkpoints/step_00000010/train_state.json").read_text())
    assert state["peft"]["rank"] == 4 and state["peft"]["base"] == {"seed": 0}
    adapters = load_file(runs["single"] / "adapter.safetensors")
    assert len(adapters) == 2 * 7 * 2 and all(k.endswith(("lora_a", "lora_b")) for k in adapters)
    merged = load_file(runs["single"] / "model.safetensors")
    assert not any(k.endswith(("lora_a", "lora_b")) for k in merged)

    # stopped at step 5 and resumed from the adapters' checkpoint: equal to the run that did not stop
    resumed = tmp_path / "resumed"
    args = train_args(corpus, resumed, *LORA, "--checkpoint.every", "5")
    assert run_cli([*args, "--training.stop_at_step", "5"], cli_env).returncode == 0
    assert run_cli(args, cli_env).returncode == 0
    assert_same_run(resumed, runs["single"], exact=True)
    # another rank, and a full fine-tune, cannot resume these adapters
    result = run_cli(train_args(corpus, resumed, "--peft.method", "lora", "--peft.rank", "8"), cli_env)
    assert_user_error(result, "holds adapters for another setting or base", "rank 4 -> 8")
    result = run_cli(train_args(corpus, resumed), cli_env)
    assert_user_error(result, "holds LoRA adapters", "peft.method is none")


@pytest.mark.multiproc
def test_peft_loads_the_exported_adapter_onto_the_base_as_the_merged_export(corpus, cli_env, tmp_path):
    """A Qwen3 (per-head norms, biases, head_dim apart from dim / heads) fine-tuned with LoRA on
    every linear: transformers + peft with the exported adapter equals the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_model("qwen3-bias", tmp_path / "base", corpus / "tokenizer.json")
    run = tmp_path / "run"
    args = train_args(corpus, run, *LORA, "--peft.alpha", "16", "--model.init_from", f"hf:{base}", model=())
    result = run_cli([*args, "--training.steps", "6", "--checkpoint.every", "6"], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    merged_dir, adapter_dir, from_ckpt = tmp_path / "merged", tmp_path / "adapter", tmp_path / "adapter-ckpt"
    assert run_cli(["export", str(run), "--out", str(merged_dir), "--dtype", "fp32"], cli_env).returncode == 0
    assert run_cli(["export", str(run), "--out", str(adapter_dir), "--adapter"], cli_env).returncode == 0
    ckpt = run / "checkpoints/step_00000006"
    assert run_cli(["export", str(ckpt), "--out", str(from_ckpt), "--adapter"], cli_env).returncode == 0
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == str(base)
    assert (
        load_file(adapter_dir / "adapter_model.safetensors").keys()
        == load_file(from_ckpt / "adapter_model.safetensors").keys()
    )

    tokens = probe_tokens()
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(tokens).logits
        before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(tokens).logits
        for directory in (adapter_dir, from_ckpt):
            plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            adapted = PeftModel.from_pretrained(plain, directory).eval()(tokens).logits
            scale = merged.abs().max().item()
            assert (adapted - merged).abs().max().item() <= 1e-4 * scale
    assert (merged - before).abs().max().item() > 1e-2  # the adapters changed the model

    # serve and generate read the LoRA run itself (its checkpoint's adapters merged into the base)
    from meshtrain.serve.loading import load_served_model

    with torch.no_grad():
        served = load_served_model(run, torch.device("cpu"), torch.float32).model(tokens)
    assert (served[..., : merged.shape[-1]] - merged).abs().max().item() <= 1e-4 * merged.abs().max().item()
    with pytest.raises(MeshtrainError, match="holds LoRA adapters alone"):
        load_served_model(adapter_dir, torch.device("cpu"), torch.float32)

    # what cannot be exported as adapters is refused in one line
    full = tmp_path / "full"
    assert run_cli(train_args(corpus, full, "--training.steps", "2"), cli_env).returncode == 0
    result = run_cli(["export", str(full), "--out", str(tmp_path / "x"), "--adapter"], cli_env)
    assert_user_error(result, "without adapters")
    result = run_cli(["export", str(run), "--out", str(tmp_path / "y"), "--adapter", "--max-shard-size", "1G"], cli_env)
    assert_user_error(result, "--max-shard-size")
    # a directory peft (or TRL) wrote has an adapter_config.json too: never replaced, its files kept;
    # meshtrain's own earlier adapter export is replaced
    peft_dir = tmp_path / "peft-run"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir).save_pretrained(peft_dir)
    (peft_dir / "training_args.bin").write_bytes(b"kept")
    result = run_cli(["export", str(run), "--out", str(peft_dir), "--adapter"], cli_env)
    assert_user_error(result, "did not write")
    assert (peft_dir / "training_args.bin").read_bytes() == b"kept"
    assert run_cli(["export", str(ckpt), "--out", str(adapter_dir), "--adapter"], cli_env).returncode == 0


@pytest.mark.multiproc
def test_the_merged_export_keeps_the_base_that_bf16_training_stored_rounded(corpus, cli_env, tmp_path):
    """Under bf16 training the frozen base is held in bf16; the merge reads the base again: every
    weight without adapters (embeddings, norms, output) is the base's bit for bit, the rest base +
    B A in fp32, so that peft's adapter on the base gives the merged export's logits (an fp32
    Llama); a zero update leaves the export equal to the base in every tensor, whatever the base's
    dtype (an fp16 Mistral, a bf16 Qwen2.5, an fp32 Llama with tied embeddings)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    bf16 = ("--training.dtype", "bf16", "--training.steps", "4")
    zero_update = "1e-30"
    for variant, lr in (
        ("llama2", "1e-2"),
        ("mistral", zero_update),
        ("qwen2.5-yarn", zero_update),
        ("llama3.2-tied", zero_update),
    ):
        base = make_model(variant, tmp_path / variant, corpus / "tokenizer.json")
        run, merged_dir, adapter_dir = (tmp_path / f"{variant}-{name}" for name in ("run", "merged", "adapter"))
        args = train_args(corpus, run, *LORA, *bf16, "--training.lr", lr, "--model.init_from", f"hf:{base}", model=())
        result = run_cli(args, cli_env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert run_cli(["export", str(run), "--out", str(merged_dir)], cli_env).returncode == 0
        want, got = load_file(base / "model.safetensors"), load_file(merged_dir / "model.safetensors")
        assert want.keys() == got.keys()
        adapted = {k for k in want if k.endswith("_proj.weight")}
        assert adapted and {k for k in want if not torch.equal(want[k], got[k])} <= adapted
        if lr == zero_update:  # nothing learned: the export is the base
            assert all(torch.equal(want[k], got[k]) for k in want)
            continue
        assert run_cli(["export", str(run), "--out", str(adapter_dir), "--adapter"], cli_env).returncode == 0
        tokens = probe_tokens()
        with torch.no_grad():
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(tokens).logits
            plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            before = plain(tokens).logits
            peft_logits = PeftModel.from_pretrained(plain, adapter_dir).eval()(tokens).logits
        assert (peft_logits - merged).abs().max().item() <= 1e-4 * merged.abs().max().item()
        assert (merged - before).abs().max().item() > 1e-2  # the adapters changed the model


def test_qlora_keeps_its_frozen_base_in_4_bit_and_trains(corpus, tmp_path):
    """The adapted linears in NF4: the bytes they hold, measured, are about half a byte a weight; the
    adapters train (bf16 compute over the dequantized base)."""
    from meshtrain.model.lora import is_nf4, lora_modules
    from meshtrain.train.base import load_base

    overrides = {
        "model": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256, "max_seq_len": 64},
        "peft": {"method": "qlora"},
        "training": {"dtype": "bf16", "lr": 1e-2, "warmup_steps": 0, "seq_len": 64},
        "data": {"path": str(corpus), "corpus": ""},
        "run": {"dir": str(tmp_path / "run")},
    }
    s = build_state(load_config(None, {"training.dtype": "fp32", **dotted(overrides)}))
    load_base(s)
    linears = lora_modules(s.model.parts[0])
    assert linears and all(is_nf4(m.weight) for m in linears)
    weights = [m.weight for m in linears]
    held = model_state_bytes(weights, s.optimizer)["params"]
    n = sum(w.numel() for w in weights)
    assert held / n < 0.56, held / n  # 4 bits + one bf16 scale per 64 weights, double-quantized
    losses = []
    for _ in range(12):
        inputs, targets, positions, n_targets = s.loader.next_batch()
        loss, _, _ = s.step(inputs, targets, n_targets, positions)
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    # merged: the dequantized base plus B A
    state = s.model.parts[0].state_dict()
    merged, adapters = merge_state_dict(state, adapters_of(s.cfg.peft))
    name = "layers.0.attention.wq"
    want = state[f"{name}.weight"].get_original_weight().float() + adapters_of(s.cfg.peft).scale * (
        adapters[f"{name}.lora_b"] @ adapters[f"{name}.lora_a"]
    )
    assert torch.equal(merged[f"{name}.weight"], want)


@pytest.mark.parametrize("ac", ["full", "op"])
def test_dropout_draws_the_same_masks_when_a_checkpointed_block_is_recomputed(ac):
    """LoRA's dropout inside a checkpointed block: the recomputation restores the RNG state, so the
    gradients are those of the run without checkpointing."""
    grads = []
    for mode in ("none", ac):
        overrides = {"peft.method": "lora", "peft.dropout": 0.5, "training.activation_checkpointing": mode}
        s = build_state(
            load_config(None, {"training.dtype": "fp32", **overrides, "run.dir": "unused", "model.n_layers": 2}),
            with_data=False,
        )
        tokens = torch.randint(0, s.args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():  # B starts at zero: give the adapters something to pass on
            for name, p in s.model.parts[0].named_parameters():
                if name.endswith("lora_b"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        torch.manual_seed(3)
        s.step(tokens[:, :-1], tokens[:, 1:])
        named = s.model.parts[0].named_parameters()
        grads.append(
            {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in named if p.grad is not None}
        )
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


# --- training.bf16_compute on LoRA's target linears (parallel/precision.py's Fp32ComputeLoRALinear) ---


@pytest.mark.parametrize("compute", ["bf16", "fp32", "bf16-attention"])
def test_bf16_compute_s_fp32_gemms_reach_the_adapted_linears(compute):
    """The adapted linears compute as the configured arithmetic says: fp32 GEMMs (tests/test_precision.py
    holds their numbers to fp32 products of the bf16 values) give the adapters gradients finer than
    bf16, which the bf16 kernels cannot."""
    from meshtrain.model.lora import LoRALinear, lora_modules
    from meshtrain.parallel.precision import FP32_CLASSES, Fp32ComputeLinear, Fp32ComputeLoRALinear

    overrides = {"peft.method": "lora", "training.dtype": "bf16", "training.bf16_compute": compute}
    s = build_state(
        load_config(None, {"training.dtype": "fp32", **overrides, "run.dir": "unused", "model.n_layers": 2}),
        with_data=False,
    )
    part = s.model.parts[0]
    fp32_gemm = FP32_CLASSES[compute][0]
    adapted = lora_modules(part)
    assert {type(m) for m in adapted} == {Fp32ComputeLoRALinear if fp32_gemm else LoRALinear}
    assert len(adapted) == 7 * 2 and (type(part.output) is Fp32ComputeLinear) == fp32_gemm
    with torch.no_grad():  # B starts at zero: give A a gradient
        for m in adapted:
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=torch.Generator().manual_seed(2)) * 0.01)
    tokens = torch.randint(0, s.args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = part(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    grads = [p.grad for m in adapted for p in (m.lora_a, m.lora_b)]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    in_bf16 = [torch.equal(g, g.to(torch.bfloat16).float()) for g in grads]
    assert not any(in_bf16) if fp32_gemm else all(in_bf16)


@pytest.fixture(scope="module")
def lora_on_a_base_without_tokenizer(corpus, cli_env, tmp_path_factory):
    """A LoRA run of 2 steps (a checkpoint at step 2) from a Hugging Face directory holding its config,
    generation config and weights only: the run's tokenizer is the data's."""
    base = make_model("llama2", tmp_path_factory.mktemp("base") / "base")
    assert not (base / "tokenizer.json").exists()
    run = tmp_path_factory.mktemp("lora-no-tokenizer") / "run"
    args = train_args(corpus, run, *LORA, "--model.init_from", f"hf:{base}", model=())
    result = run_cli([*args, "--training.steps", "2", "--checkpoint.every", "2"], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_adapter_export_refuses_a_damaged_or_uncommitted_checkpoint(
    lora_on_a_base_without_tokenizer, cli_env, tmp_path
):
    """`export --adapter` read a checkpoint's shards without checking them: changed bytes were written out
    as adapters, an uncommitted save exported, and one without train_state.json a traceback. It verifies
    the checkpoint as the merged export does, in one line."""
    import shutil

    from meshtrain.checkpoint import MARKER, TRAIN_STATE
    from meshtrain.errors import CheckpointError
    from meshtrain.interop.hf import export_adapter

    run = shutil.copytree(lora_on_a_base_without_tokenizer, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000002"
    assert export_adapter(ckpt, tmp_path / "good").is_dir()
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(range(16))
    shard.write_bytes(bytes(data))
    result = run_cli(["export", str(ckpt), "--out", str(tmp_path / "damaged"), "--adapter"], cli_env)
    assert_user_error(result, "__0_0.distcp does not match its checksum")
    (ckpt / MARKER).unlink()
    for missing in ((), (TRAIN_STATE,)):
        for name in missing:
            (ckpt / name).unlink()
        with pytest.raises(CheckpointError, match="was never committed"):
            export_adapter(ckpt, tmp_path / "uncommitted")
    assert not (tmp_path / "damaged").exists() and not (tmp_path / "uncommitted").exists()


def test_export_of_a_run_from_a_base_without_tokenizer_writes_the_runs(lora_on_a_base_without_tokenizer, tmp_path):
    """The run kept its base's files (hf_source/, no tokenizer among them) and the data's tokenizer; the
    export copied the base's files only and wrote no tokenizer at all. It writes the run's, with its
    tokenizer_config.json, as a fresh run's export does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from meshtrain.interop import export_hf

    run = lora_on_a_base_without_tokenizer
    out = export_hf(run, tmp_path / "hf")
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    text = "def f(x):\n    return x + 1\n"
    want = Tokenizer.from_file(str(run / "tokenizer.json")).encode(text).ids
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == want
    assert AutoTokenizer.from_pretrained(out, local_files_only=True)(text)["input_ids"] == want
