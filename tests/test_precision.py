"""bf16 training with fp32 arithmetic: the numbers of the bf16 kernels, bf16 storage, fp32 speed."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshtrain import hardware
from meshtrain.model import Llama
from meshtrain.model.llama import Attention, ModelArgs
from meshtrain.parallel import precision
from meshtrain.parallel.compile import COMPILE_OPTIONS
from meshtrain.parallel.precision import Fp32ComputeAttention, Fp32ComputeLinear, apply_fp32_compute

BF16 = torch.bfloat16


def linear_pair(bias: bool):
    torch.manual_seed(0)
    native = nn.Linear(64, 96, bias=bias)
    ours = nn.Linear(64, 96, bias=bias)
    ours.load_state_dict(native.state_dict())
    ours.__class__ = Fp32ComputeLinear
    return native, ours


@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_the_bf16_gemm_numbers(bias):
    native, ours = linear_pair(bias)
    x = torch.randn(4, 32, 64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = []
    for layer, xi in zip((native, ours), xs):
        with torch.autocast("cpu", dtype=BF16):
            out = layer(xi)
        assert out.dtype == BF16
        (out.float() * torch.linspace(-1, 1, 96)).sum().backward()
        outs.append(out)
    # Exactly the fp32 product of the bf16-rounded operands, rounded to bf16 like autocast's output.
    expected = x.to(BF16).float() @ native.weight.to(BF16).float().t()
    if bias:
        expected = expected + native.bias.to(BF16).float()
    torch.testing.assert_close(outs[1], expected.to(BF16), rtol=0, atol=0)
    # And the bf16 kernel's numbers, up to the order of the fp32 sums.
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(ours.weight.grad, native.weight.grad, rtol=2e-2, atol=1e-2)
    assert ours.weight.grad.dtype == torch.float32
    if bias:
        torch.testing.assert_close(ours.bias.grad, native.bias.grad, rtol=2e-2, atol=1e-2)


def test_linear_saves_only_bf16_and_is_plain_without_bf16():
    _, ours = linear_pair(False)
    x = torch.randn(8, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        with torch.autocast("cpu", dtype=BF16):
            ours(x)
    assert saved and set(saved) == {BF16}  # activation memory stays that of bf16 training
    torch.testing.assert_close(ours(x), F.linear(x, ours.weight), rtol=0, atol=0)  # fp32 training: untouched


def test_compiled_linear_keeps_the_bf16_rounding():
    """Inductor would fuse the round trip to bf16 away; training.compile must give the eager numbers."""
    _, ours = linear_pair(False)
    norm = nn.RMSNorm(64)

    def f(x):
        with torch.autocast("cpu", dtype=BF16):
            return ours(norm(x) * 1.7)

    x = torch.randn(4, 32, 64)
    torch.testing.assert_close(torch.compile(f, options=COMPILE_OPTIONS)(x), f(x), rtol=0, atol=0)


def test_attention_runs_in_fp32_on_bf16_inputs():
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
    attn = Attention(args)
    q, k, v = (torch.randn(2, h, 16, 16).to(BF16) for h in (4, 2, 2))
    native = attn.attend(q, k, v)
    attn.__class__ = Fp32ComputeAttention
    ours = attn.attend(q, k, v)
    assert ours.dtype == BF16
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, expected.to(BF16), rtol=0, atol=0)
    torch.testing.assert_close(ours.float(), native.float(), rtol=2e-2, atol=2e-2)


def train_losses(fp32_compute: bool, steps: int = 4) -> list[float]:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=32)
    model = Llama(args)
    model.init_weights(0)
    names = [n for n, _ in model.named_parameters()]
    if fp32_compute:
        apply_fp32_compute(model)
        assert [n for n, _ in model.named_parameters()] == names
        assert all(type(m) is not nn.Linear for m in model.modules())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=BF16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_training_follows_the_bf16_kernels():
    native, ours = train_losses(False), train_losses(True)
    assert ours[-1] < ours[0] - 0.05  # it learns
    for a, b in zip(native, ours, strict=True):
        assert abs(a - b) <= 5e-3 * a, (native, ours)


def test_auto_picks_the_arithmetic_measured_faster_on_this_cpu(monkeypatch, tmp_path):
    def training(dtype="bf16", mode="auto"):
        return types.SimpleNamespace(dtype=dtype, bf16_compute=mode)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not precision.wants_fp32_compute(training("fp32", "fp32"), cpu)
    assert not precision.wants_fp32_compute(training(mode="bf16"), cpu)
    assert precision.wants_fp32_compute(training(mode="fp32"), cuda)
    assert not precision.wants_fp32_compute(training(), cuda)  # GPUs: bf16 kernels
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(hardware, "_bf16_time_ratio", lambda: calls.append(1) or 0.4)  # bf16 measured faster
    assert not precision.wants_fp32_compute(training(), cpu)
    assert precision.arithmetic_dtype(training(), cpu) == BF16
    monkeypatch.setattr(hardware, "_bf16_time_ratio", lambda: calls.append(1) or 2.5)
    assert not precision.wants_fp32_compute(training(), cpu)  # measured once per CPU, then cached
    assert len(calls) == 1
    (tmp_path / "meshtrain" / "cpu_peak.json").unlink()
    assert precision.wants_fp32_compute(training(), cpu)  # a machine where bf16 loses
    assert precision.arithmetic_dtype(training(), cpu) == torch.float32
    assert precision.arithmetic_dtype(training("fp32", "auto"), cuda) == torch.float32


def test_the_probe_measures_both_arithmetics():
    ratio = hardware._bf16_time_ratio(repeats=1)
    assert math.isfinite(ratio) and ratio > 0


def test_mfu_is_against_the_best_peak_whatever_arithmetic_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "cpu_peak_tflops", lambda dtype: {BF16: 0.15, torch.float32: 0.3}[dtype])
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "bf16") == 0.3
    monkeypatch.setattr(hardware, "cpu_peak_tflops", lambda dtype: {BF16: 0.9, torch.float32: 0.3}[dtype])
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "bf16") == 0.9
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "fp32") == 0.3
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "bf16", override=2.0) == 2.0
