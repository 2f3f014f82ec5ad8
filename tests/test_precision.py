"""bf16 training with fp32 arithmetic: the numbers of the bf16 kernels, bf16 storage, fp32 speed."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import pretend_other_load
from meshtrain import hardware
from meshtrain.errors import MeshtrainError
from meshtrain.job import arithmetic
from meshtrain.job.model import model_args
from meshtrain.model import Llama
from meshtrain.model.llama import Attention, ModelArgs
from meshtrain.parallel import precision
from meshtrain.parallel.compile import EXACT_CASTS
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
    torch.testing.assert_close(torch.compile(f, options=EXACT_CASTS)(x), f(x), rtol=0, atol=0)


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


def test_one_class_at_a_time_swaps_only_its_modules():
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=32)
    for compute, (gemm, attention) in precision.FP32_CLASSES.items():
        model = Llama(args)
        apply_fp32_compute(model, gemm, attention)
        kinds = {type(m) for m in model.modules()}
        assert (Fp32ComputeLinear in kinds) == gemm and (nn.Linear in kinds) == (not gemm), compute
        assert (Fp32ComputeAttention in kinds) == attention and (Attention in kinds) == (not attention), compute


def config(dtype="auto", compute="auto", **training):
    from meshtrain.config import load_config

    overrides = {"model.preset": "tiny", "training.dtype": dtype, "training.bf16_compute": compute}
    return load_config(overrides=overrides | {f"training.{k}": v for k, v in training.items()})


def fake_probe(monkeypatch, block_ms: dict, head_ms: dict, calls: list, bf16_gemm_slowdown: float = 1.0):
    def probe(args, sequences, seq_len, names, compiled=None):
        calls.append(names)
        return {n: block_ms[n] for n in names}, head_ms

    monkeypatch.setattr(arithmetic, "probe", probe)
    monkeypatch.setattr(arithmetic, "bf16_gemm_slowdown", lambda args: bf16_gemm_slowdown)
    pretend_other_load(monkeypatch, 0.0)  # a fake probe takes no time: the machine's load in it is noise


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_resolves_from_the_config_the_device_or_the_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    # bf16 GEMMs win, bf16 attention loses: bf16 GEMMs with fp32 attention, on the model's own block.
    blocks = {"bf16": 10.0, "fp32": 30.0, "bf16/bf16-gemm": 8.0, "bf16/bf16-attention": 31.0, "bf16/fp32": 29.0}
    heads = {"bf16": 5.0, "fp32": 15.0, "bf16/fp32": 16.0}
    fake_probe(monkeypatch, blocks, heads, calls)
    args = model_args(config())
    for cfg, device, expected, how in [
        (config("fp32"), CPU, ("fp32", "auto"), "given"),
        (config("bf16", "fp32"), CPU, ("bf16", "fp32"), "given"),
        (config("auto", "bf16-attention"), CPU, ("bf16", "bf16-attention"), "given"),  # implies bf16 storage
        (config(), CUDA, ("bf16", "bf16"), "device"),
        (config("bf16", "fp32"), CUDA, ("bf16", "fp32"), "given"),
        (config(), CPU, ("bf16", "bf16-gemm"), "measured"),
        (config(), CPU, ("bf16", "bf16-gemm"), "cached"),  # once per CPU, threads, torch and shape
    ]:
        resolved, choice = arithmetic.resolve(cfg, args, device)
        assert (resolved.training.dtype, resolved.training.bf16_compute) == expected, (cfg.training, device)
        assert (choice.dtype, choice.bf16_compute, choice.how) == (*expected, how)
    assert len(calls) == 1
    cache = tmp_path / "meshtrain" / "arithmetic.json"
    cache.write_text(json.dumps({k: {"choice": "fp32"} for k in json.loads(cache.read_text())}))  # another format
    assert arithmetic.resolve(config(), args, CPU)[1].how == "measured" and len(calls) == 2
    _, choice = arithmetic.resolve(config(micro_batch_size=2, global_batch_size=2), args, CPU)
    assert choice.how == "measured" and len(calls) == 3  # another shape is measured again
    # A micro-batch's time: n_layers blocks plus the head in the candidate's GEMM arithmetic, scaled
    # from the probed sequences (512 tokens: 2 of 256) to the micro-batch (2 sequences: x1).
    assert choice.step_ms["bf16/bf16-gemm"] == pytest.approx(args.n_layers * 8.0 + 5.0)
    assert choice.step_ms["bf16/bf16-attention"] == pytest.approx(args.n_layers * 31.0 + 16.0)
    assert choice.step_ms["fp32"] == pytest.approx(args.n_layers * 30.0 + 15.0)
    # dtype bf16: only bf16 storage is a candidate, so plain fp32 is never timed nor chosen.
    _, choice = arithmetic.resolve(config("bf16", seq_len=128), args, CPU)
    assert "fp32" not in calls[-1] and "fp32" not in choice.step_ms


def test_fp32_wins_where_bf16_is_emulated_and_ties_keep_all_bf16(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    emulated = {"bf16": 300.0, "fp32": 10.0, "bf16/bf16-gemm": 280.0, "bf16/bf16-attention": 40.0, "bf16/fp32": 11.0}
    calls = []
    fake_probe(monkeypatch, emulated, {"bf16": 200.0, "fp32": 5.0, "bf16/fp32": 6.0}, calls)
    cfg, choice = arithmetic.resolve(config(), model_args(config()), CPU)
    assert (cfg.training.dtype, choice.name) == ("fp32", "fp32")
    assert "fp32" in choice.describe() and "measured" in choice.describe()
    # Where a bf16 GEMM alone reads that far behind, the candidates computing GEMMs in bf16 are not
    # probed at all (their first looks are minutes at `small`'s shapes), and the choice is the same.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "screened"))
    monkeypatch.setattr(arithmetic, "bf16_gemm_slowdown", lambda args: 30.0)
    cfg, choice = arithmetic.resolve(config(), model_args(config()), CPU)
    assert calls[-1] == ["fp32", "bf16/bf16-attention", "bf16/fp32"] and choice.name == "fp32"
    assert "bf16 GEMMs 30x fp32's here (emulated)" in choice.describe()
    # FP8 computes the GEMMs: the candidates left differ in their attention alone, none screened out
    cfg, choice = arithmetic.resolve(config("bf16", fp8="tensorwise"), model_args(config()), CPU)
    assert calls[-1] == ["bf16", "bf16/bf16-gemm"] and choice.bf16_gemm_slowdown == 0.0
    # All-bf16 is kept unless beaten by more than noise (fp32) or than the casts of fp32 arithmetic on
    # bf16 storage cost a compiled step (the mixed candidates): near-equals do not flip the choice.
    assert arithmetic.choose({"bf16": 102.0, "fp32": 100.0}) == "bf16"
    assert arithmetic.choose({"bf16": 104.0, "fp32": 100.0}) == "fp32"
    assert arithmetic.choose({"bf16": 104.0, "bf16/bf16-gemm": 100.0, "fp32": 150.0}) == "bf16"
    assert arithmetic.choose({"bf16": 115.0, "bf16/bf16-gemm": 100.0, "bf16/fp32": 104.0}) == "bf16/bf16-gemm"


def test_the_probe_times_every_candidate_at_the_model_s_shapes():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    names = [name for name, _, _ in arithmetic.CANDIDATES]
    blocks, heads = arithmetic.probe(args, 2, 64, names)
    assert set(blocks) == set(names) and set(heads) == {"bf16", "fp32", "bf16/fp32"}
    assert all(math.isfinite(ms) and ms > 0 for ms in [*blocks.values(), *heads.values()])


def test_the_bf16_gemm_slowdown_is_measured_once_per_cpu_and_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    slowdown = arithmetic.bf16_gemm_slowdown(args)
    assert math.isfinite(slowdown) and slowdown > 0
    monkeypatch.setattr(torch, "mm", lambda *a: pytest.fail("measured again"))
    assert arithmetic.bf16_gemm_slowdown(args) == slowdown


def test_fp32_training_refuses_a_bf16_arithmetic():
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="training.bf16_compute = 'bf16-gemm'.*training.dtype is fp32"):
        config("fp32", "bf16-gemm")
    with pytest.raises(MeshtrainError, match="still 'auto'"):
        precision.fp32_classes(config().training)


def test_mfu_is_against_the_best_peak_whatever_arithmetic_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "cpu_peak_tflops", lambda dtype: {BF16: 0.15, torch.float32: 0.3}[dtype])
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "bf16") == 0.3
    monkeypatch.setattr(hardware, "cpu_peak_tflops", lambda dtype: {BF16: 0.9, torch.float32: 0.3}[dtype])
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "bf16") == 0.9
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "fp32") == 0.3
    assert hardware.mfu_peak_tflops(torch.device("cpu"), "bf16", override=2.0) == 2.0


def test_a_busy_machine_is_seen_and_its_probe_is_retaken_on_one_thread_and_not_reused(monkeypatch, tmp_path):
    import subprocess
    import sys
    import time

    for _ in range(
        6
    ):  # an idle half-second (what earlier tests left running, such as inductor's compile workers, may end first)
        with arithmetic.OtherLoad() as quiet:
            time.sleep(0.5)
        if quiet.share < 0.2:
            break
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        with arithmetic.OtherLoad() as busy:
            time.sleep(1.0)
    finally:
        for p in spinners:
            p.wait()
    assert busy.share > 0.6 > arithmetic.BUSY and busy.share > quiet.share + 0.4, (busy.share, quiet.share)

    # A busy first look: the probe again on one thread, the choice taken from it, not cached.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    pretend_other_load(monkeypatch, 0.7)
    threads = []

    def probe(args, sequences, seq_len, names, compiled=None):
        threads.append(torch.get_num_threads())
        gemm = 8.0 if threads[-1] == 1 else 30.0  # the busy look reads bf16 GEMMs slow, the one-thread look fast
        return {n: {"bf16/bf16-gemm": gemm}.get(n, 10.0) for n in names}, {"bf16": 5.0, "fp32": 5.0, "bf16/fp32": 5.0}

    monkeypatch.setattr(arithmetic, "probe", probe)
    monkeypatch.setattr(arithmetic, "bf16_gemm_slowdown", lambda args: 1.0)
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for start in range(2):
            _, choice = arithmetic.resolve(config(), model_args(config()), CPU)
            assert (choice.name, choice.how, choice.busy) == ("bf16/bf16-gemm", "busy", 0.7)
            assert threads[-3:] == [2, 1, 1] and len(threads) == 3 * (start + 1)  # measured again at the next start
        assert "other processes used 70% of the CPUs" in choice.describe()
        pretend_other_load(monkeypatch, 0.01)  # a quiet start: kept
        assert arithmetic.resolve(config(), model_args(config()), CPU)[1].how == "measured"
        assert arithmetic.resolve(config(), model_args(config()), CPU)[1].how == "cached"
    finally:
        torch.set_num_threads(original)


def test_a_contender_near_its_margin_is_timed_again():
    assert arithmetic.near_margin({"bf16": 104.0, "bf16/bf16-gemm": 100.0}, "bf16/bf16-gemm")  # 4% vs 5%
    assert not arithmetic.near_margin({"bf16": 120.0, "bf16/bf16-gemm": 100.0}, "bf16/bf16-gemm")
    assert not arithmetic.near_margin({"bf16": 95.0, "bf16/bf16-gemm": 100.0}, "bf16/bf16-gemm")


FAULTS = """
import resource, sys, torch
from meshtrain.hardware import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
for _ in range(20):  # the heap grows to the block's size
    torch.empty(2**24).fill_(1.0)  # 64 MiB: over glibc's largest mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(2**24).fill_(1.0)
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    def faults(mode: str) -> tuple[str, float]:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
        kept, per_block = out.stdout.split()
        return kept, float(per_block)

    default, kept = faults("default"), faults("keep")
    # by default each block is mapped afresh and every page faulted in (16,384 of 4 KiB); kept, its
    # pages are reused
    assert default[0] == "False" and default[1] >= 16
    assert kept[0] == "True" and kept[1] <= default[1] / 10


# --- LoRA/QLoRA's target linears under fp32 GEMM arithmetic (parallel/precision.py's Fp32ComputeLoRALinear) ---


def lora_linear(quantized: bool):
    """A LoRA linear (64 -> 96, rank 8) on a bf16 frozen base (NF4 with `quantized`), B nonzero."""
    from meshtrain.model.args import LoraSpec
    from meshtrain.model.lora import LoRALinear, freeze_base, quantize_base

    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(64, 96, bias=True), LoraSpec("qlora" if quantized else "lora", rank=8))
    with torch.no_grad():
        layer.lora_a.copy_(torch.randn(8, 64) * 0.1)
        layer.lora_b.copy_(torch.randn(96, 8) * 0.1)
    freeze_base(layer, BF16)
    if quantized:
        quantize_base(layer)
    return layer


def forward_backward(forward, x: torch.Tensor, adapters: list[torch.Tensor]):
    """The output, x's gradient and the adapters' of one forward + backward under bf16 autocast."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        out = forward(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out, x.grad] + [p.grad for p in adapters]


@pytest.mark.parametrize("quantized", [False, True])
def test_lora_linears_compute_in_fp32_on_bf16_values_under_fp32_gemms(quantized):
    """Base (QLoRA's dequantised) and adapters: each matmul Fp32ComputeLinear's, not the bf16 kernel."""
    from meshtrain.model.lora import is_nf4

    x = torch.randn(4, 32, 64)
    native = lora_linear(quantized)
    ours = lora_linear(quantized)
    apply_fp32_compute(ours, gemm=True, attention=False)
    assert type(ours) is precision.Fp32ComputeLoRALinear and is_nf4(ours.weight) == quantized

    def saved(layer) -> list[tuple[bool, int]]:
        keep = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: keep.append((is_nf4(t), t.numel())) or t, lambda t: t):
            forward_backward(layer, x, [])
        return sorted(keep)

    # what autograd keeps, as the bf16 kernels do: NF4 stays NF4, a frozen base keeps no input
    assert saved(ours) == saved(native)
    native.zero_grad(), ours.zero_grad()
    bf16_kernels = forward_backward(native, x, [native.lora_a, native.lora_b])
    got = forward_backward(ours, x, [ours.lora_a, ours.lora_b])

    def fp32_linear(weight, bias=None):
        linear = Fp32ComputeLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
        linear.weight, linear.bias = weight, bias
        return linear

    # the same module as three fp32-arithmetic linears on the bf16 (dequantised) base and the adapters
    base = nn.Parameter(ours.weight.get_original_weight() if quantized else ours.weight.detach(), requires_grad=False)
    assert base.dtype == BF16
    a, b = (nn.Parameter(p.detach().clone()) for p in (ours.lora_a, ours.lora_b))
    linears = fp32_linear(base, ours.bias), fp32_linear(a), fp32_linear(b)
    want = forward_backward(lambda x: linears[0](x) + linears[2](linears[1](x)) * ours.scale, x, [a, b])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    x16 = x.to(BF16).float()  # and the forward is the fp32 product of the bf16-rounded operands
    adapter = ((x16 @ a.to(BF16).float().t()).to(BF16).float() @ b.to(BF16).float().t()).to(BF16)
    base_out = (x16 @ base.float().t() + ours.bias.to(BF16).float()).to(BF16)
    torch.testing.assert_close(got[0], base_out + adapter * ours.scale, rtol=0, atol=0)
    # the bf16 kernels' numbers up to summation order, but their weight gradients come rounded to bf16
    torch.testing.assert_close(got[0].float(), bf16_kernels[0].float(), rtol=1e-2, atol=1e-2)
    for g, native_g in zip(got[2:], bf16_kernels[2:], strict=True):
        torch.testing.assert_close(g, native_g, rtol=2e-2, atol=1e-3)
        assert torch.equal(native_g, native_g.to(BF16).float()) and not torch.equal(g, g.to(BF16).float())
