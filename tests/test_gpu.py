"""One GPU (skipped without CUDA; never needed by CI): every single-device feature trains on it.

Each case is a short bf16 run of the test model on `--launch.device cuda`, held to the plain bf16
run on the same GPU: compile (also with CUDA graphs, with one micro-batch a step and with two), full
and selective checkpointing and ZeRO-3 at world 1 give the same loss curve (within bf16/kernel-order
tolerance); a stopped and resumed run continues the same
curve; the exported model gives transformers' logits; dtype auto takes bf16 from the device; document
masking runs FlexAttention, equal to each document alone, and trains compiled like eager."""

import json

import pytest
import torch

from conftest import read_metrics, run_cli, train_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (`gpu` marker)"),
]

GPU = ["--launch.device", "cuda", "--training.dtype", "bf16", "--training.steps", "12"]
VARIANTS = {
    "compile": ["--training.compile", "true"],
    "cuda-graphs": ["--training.compile", "true", "--training.cuda_graphs", "true"],  # 2 micro-batches a step
    "cuda-graphs-one-micro-batch": [
        "--training.compile",
        "true",
        "--training.cuda_graphs",
        "true",
        "--training.micro_batch_size",
        "8",
    ],
    "ac-full": ["--training.activation_checkpointing", "full"],
    "ac-selective": ["--training.activation_checkpointing", "selective"],
    "zero3-world1": ["--parallel.zero", "3"],
}


def gpu_run(corpus, cli_env, run_dir, *extra):
    result = run_cli(train_args(corpus, run_dir, *GPU, *extra), cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def baseline(corpus, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpu-base")
    return run_dir, gpu_run(corpus, cli_env, run_dir)


def test_bf16_training_runs_on_the_gpu_with_honest_mfu(baseline):
    _, metrics = baseline
    assert metrics[-1]["loss"] < metrics[0]["loss"] and all(m["arithmetic"] == "bf16" for m in metrics)
    assert all(0 < m["mfu"] < 1 for m in metrics if "mfu" in m)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_feature_gives_the_same_losses(name, baseline, corpus, cli_env, tmp_path):
    got = gpu_run(corpus, cli_env, tmp_path, *VARIANTS[name])
    for ref, m in zip(baseline[1], got, strict=True):
        assert m["loss"] == pytest.approx(ref["loss"], rel=2e-2), (name, m["step"])


def test_stop_and_resume_continue_the_same_curve(baseline, corpus, cli_env, tmp_path):
    first = gpu_run(corpus, cli_env, tmp_path, "--checkpoint.every", "6", "--training.stop_at_step", "6")
    assert [m["step"] for m in first][-1] == 6
    resumed = gpu_run(corpus, cli_env, tmp_path, "--checkpoint.every", "6")
    for ref, m in zip(baseline[1][6:], [m for m in resumed if m["step"] > 6], strict=True):
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-2), m["step"]


def test_export_gives_transformers_logits(baseline, cli_env, tmp_path):
    from transformers import AutoModelForCausalLM

    from meshtrain.interop.hf import load_full_model

    run_dir, _ = baseline
    result = run_cli(["export", str(run_dir), "--out", str(tmp_path / "hf")], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, args, _ = load_full_model(run_dir)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, torch_dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours.cuda()(tokens.cuda())[..., : args.vocab_size].cpu()
        theirs = hf.cuda()(tokens.cuda()).logits.cpu()
    assert (mine - theirs).abs().max().item() <= 1e-3


def test_fp16_with_loss_scaling_follows_bf16(baseline, corpus, cli_env, tmp_path):
    got = gpu_run(corpus, cli_env, tmp_path, "--training.dtype", "fp16")
    assert all(m["arithmetic"] == "fp16" and m["loss_scale"] >= 1 for m in got)
    for ref, m in zip(baseline[1], got, strict=True):
        if m["skipped_steps"] == 0:  # the first steps may overflow while the scale settles
            assert m["loss"] == pytest.approx(ref["loss"], rel=3e-2), m["step"]


def test_fp8_trains_where_the_gpu_has_fp8_units_and_is_refused_elsewhere(baseline, corpus, cli_env, tmp_path):
    args = train_args(corpus, tmp_path, *GPU, "--training.fp8", "tensorwise")
    result = run_cli(args, cli_env)
    if torch.cuda.get_device_capability() < (8, 9):
        assert result.returncode == 2 and "needs FP8 units" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    for ref, m in zip(baseline[1], read_metrics(tmp_path), strict=True):
        assert m["loss"] == pytest.approx(ref["loss"], rel=5e-2), m["step"]


def test_dtype_auto_takes_bf16_from_the_device(corpus, cli_env, tmp_path):
    args = train_args(corpus, tmp_path, *GPU, "--training.dtype", "auto", "--training.steps", "2")
    result = run_cli(args, cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    choice = json.loads((tmp_path / "arithmetic.json").read_text())
    assert (choice["dtype"], choice["bf16_compute"], choice["how"]) == ("bf16", "bf16", "device")
    assert (choice["attention_backward"]["kind"], choice["attention_backward"]["how"]) == ("flash", "device")
    assert all(m["arithmetic"] == "bf16" for m in read_metrics(tmp_path))
    refused = run_cli([*args, "--training.attention_backward", "recompute"], cli_env)  # a CPU kernel's backward
    assert refused.returncode != 0 and "attention_backward = 'recompute'" in refused.stderr


def test_document_masking_runs_flex_attention_and_equals_each_document_alone():
    """On CUDA the mask is a FlexAttention block mask; packed logits and gradients equal each
    document run alone (fp32, so the tolerance is the kernels' order of summation only)."""
    import torch.nn.functional as F

    from meshtrain.model import Llama, ModelArgs
    from meshtrain.model.masks import DocumentMask

    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=211, max_seq_len=512)
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cuda")
    model.init_weights(0)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, args.vocab_size, (n,), generator=gen).cuda() for n in (130, 61, 200, 121)]
    tokens = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d), device="cuda") for d in docs])[None]
    assert DocumentMask(positions).kernel == "flex"

    def loss_and_grads(forward):
        model.zero_grad()
        loss = forward()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def targets(d):
        return torch.cat([d[1:], torch.tensor([-100], device="cuda")])

    packed, packed_grads = loss_and_grads(
        lambda: F.cross_entropy(model(tokens, positions)[0], torch.cat([targets(d) for d in docs]), reduction="sum")
    )
    alone, alone_grads = loss_and_grads(
        lambda: sum(F.cross_entropy(model(d[None])[0], targets(d), reduction="sum") for d in docs)
    )
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-3)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_document_masking_trains_compiled_like_eager(corpus, cli_env, tmp_path):
    eager = gpu_run(corpus, cli_env, tmp_path / "eager", "--training.seq_len", "256", "--model.max_seq_len", "256")
    compiled = gpu_run(
        corpus,
        cli_env,
        tmp_path / "compiled",
        "--training.seq_len",
        "256",
        "--model.max_seq_len",
        "256",
        "--training.compile",
        "true",
    )
    for ref, m in zip(eager, compiled, strict=True):
        assert m["loss"] == pytest.approx(ref["loss"], rel=2e-2), m["step"]
