"""The model families people fine-tune, in and out of the Hugging Face format: for every variant
that changes the math (RoPE scalings, biases, a separate head dimension, tied embeddings, Qwen3's
q/k norms; fp32, bf16 and fp16 on disk; one file or two with an index), logits equal to
transformers' on one process and on TP 2, PP 2 and ZeRO-3, greedy decoding equal to transformers'
`generate`, import -> export bitwise, and every field meshtrain cannot compute refused by name."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_families import VARIANTS, assert_close_logits, hf_logits, make_model, probe_tokens
from safetensors.torch import load_file

from conftest import assert_user_error, field_paths, read_metrics, run_cli, train_args, with_field
from meshtrain.errors import MeshtrainError
from meshtrain.interop import export_hf, hf_model_args, load_hf_weights
from meshtrain.interop.families import args_to_config, config_to_args, same_model
from meshtrain.interop.hf import end_tokens, load_full_model
from meshtrain.interop.hf_import import keep_source_files
from meshtrain.interop.weights import save_model
from meshtrain.model import PRESETS, Llama
from meshtrain.serve.engine import Engine, SamplingParams


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def models(corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_model(name, root / name, corpus / "tokenizer.json") for name in VARIANTS}


def imported(directory: Path) -> Llama:
    args = hf_model_args(directory)
    model = Llama(args)
    model.init_weights(seed=1)  # every weight is then overwritten by the import
    load_hf_weights([model], directory, args)
    return model.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(variant, models):
    tokens = probe_tokens()
    with torch.no_grad():
        ours = imported(models[variant])(tokens)
    assert_close_logits(ours, hf_logits(models[variant], tokens))


@pytest.fixture(scope="module")
def larger_model(tmp_path_factory) -> Path:
    """A 130 MB fp32 Llama whose largest tensor (the embedding) is an eighth of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=128,
    )
    out = tmp_path_factory.mktemp("larger") / "llama"
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.multiproc
def test_tp_pp_and_zero3_imports_give_transformers_logits(models, larger_model, cli_env, tmp_path):
    """One launch of 2 processes builds every layout for one model of each family (the two-file
    bf16 Llama 3.1, fp16 Mistral, a tied Qwen2, Qwen3 with biases and q/k norms) with the trainer's
    own build and import; the pipeline's second stage holds the logits. Then each rank imports a
    larger model under ZeRO-3 and measures its memory: its shard plus a few copies of the largest
    tensor at most, never the whole model."""
    chosen = ["llama3.1", "mistral", "qwen2-tied", "qwen3-bias"]
    worker = Path(__file__).parent / "hf_layouts_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker)]
    result = subprocess.run(
        [*cmd, str(tmp_path), *(str(models[name]) for name in chosen), f"memory:{larger_model}"],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = probe_tokens()
    for name in chosen:
        theirs = hf_logits(models[name], tokens)
        for layout in ("tp2", "pp2", "zero3"):
            assert_close_logits(torch.load(tmp_path / f"{name}-{layout}.pt"), theirs)
    weights = read_weights(larger_model)
    whole = sum(t.numel() * 4 for t in weights.values())
    largest = max(t.numel() * 4 for t in weights.values())
    for rank in (0, 1):
        peak = json.loads((tmp_path / f"memory-{rank}.json").read_text())["peak"]
        # the shard is allocated before the import; the import adds the tensor in flight (read,
        # reordered for the rotation or padded, cut to this rank's rows)
        assert peak <= 3 * largest + (8 << 20) and peak < whole / 2, (peak, largest, whole)


def greedy(directory: Path, prompt: list[int], n: int) -> list[int]:
    from tokenizers import Tokenizer

    model, tokenizer = imported(directory), Tokenizer.from_file(str(directory / "tokenizer.json"))
    engine = Engine(model, tokenizer, eos_ids=None, max_batch=1, max_context=model.args.max_seq_len)
    try:
        _, _, request = engine.complete(prompt, SamplingParams(max_tokens=n, temperature=0.0))
    finally:
        engine.close()
    return request.generated


@pytest.mark.parametrize(
    "variant", ["llama3.1", "llama-biases-head-dim", "mistral", "qwen2.5-yarn", "qwen3-tied", "qwen3-moe", "mixtral"]
)
def test_greedy_decoding_equals_transformers_generate(variant, models):
    """The serving engine (KV cache, continuous batching) against transformers' generate."""
    from transformers import AutoModelForCausalLM

    prompt = probe_tokens()[0, :20].tolist()
    hf = AutoModelForCausalLM.from_pretrained(models[variant], local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert greedy(models[variant], prompt, 24) == theirs[0, 20:].tolist()


def test_meshtrain_generate_stops_where_transformers_does(models, cli_env):
    """`meshtrain generate DIR` on a Hugging Face directory: the model's tokenizer, greedy, and the
    model's own end token, against transformers with the same end token."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    directory = models["qwen3-tied"]
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt = "def main():\n    return"
    ids = tokenizer.encode(prompt).ids
    eos = tokenizer.token_to_id("<|endoftext|>")
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    expected = [t for t in out[0, len(ids) :].tolist() if t != eos]
    result = run_cli(
        ["generate", str(directory), "--prompt", prompt, "--temperature", "0", "--max-tokens", "20", "--device", "cpu"],
        cli_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.rstrip("\n") == prompt + tokenizer.decode(expected)


def test_end_tokens_are_every_id_the_model_names(models, tmp_path):
    """Llama 3 instruct: generation_config.json's eos_token_id is a list (<|eot_id|>, <|end_of_text|>),
    and tokenizer_config.json's eos_token (what chat templates render and data prepare ends turns
    with) may be another token than the tokenizer's end of text."""
    from tokenizers import Tokenizer

    from meshtrain.data.tokenizer import end_of_text

    directory = models["llama2"]
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    turn_end = tokenizer.id_to_token(300)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 11}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": turn_end}}))
    token, ids = end_tokens(tmp_path, tokenizer)
    assert token == turn_end and ids == [7, 9, 11, 300]
    assert end_of_text(tokenizer, tmp_path) == (turn_end, 300)
    assert end_of_text(tokenizer) == ("<|endoftext|>", tokenizer.token_to_id("<|endoftext|>"))
    engine = Engine(imported(directory), tokenizer, ids, max_batch=1, max_context=64)
    try:
        assert engine.eos_ids == {7, 9, 11, 300}
    finally:
        engine.close()


@pytest.mark.parametrize("variant", VARIANTS)
def test_import_then_export_is_bitwise_and_transformers_reads_it(variant, models, tmp_path):
    """A run's final weights of an imported model, exported: the same tensors in the same dtype, the
    same config.json, and transformers' logits from the export equal meshtrain's."""
    source = models[variant]
    model = imported(source)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_model(model.state_dict(), model.args, run_dir)
    (run_dir / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    keep_source_files(source, run_dir)
    out = export_hf(run_dir, tmp_path / "export")

    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    theirs, ours = read_weights(source), read_weights(out)
    assert theirs.keys() == ours.keys()
    assert all(theirs[k].dtype == ours[k].dtype and torch.equal(theirs[k], ours[k]) for k in theirs)
    tokens = probe_tokens()
    with torch.no_grad():
        assert_close_logits(load_full_model(run_dir)[0](tokens), hf_logits(out, tokens))


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_a_model_trained_from_scratch_exports_as_its_family(corpus, cli_env, tmp_path):
    """Qwen3's options on meshtrain's own model (q/k norms, a separate head dimension) write a
    Qwen3 directory that transformers computes the same logits from."""
    run = tmp_path / "run"
    args = ["--model.family", "qwen3", "--model.qk_norm", "true", "--model.head_dim", "32", "--training.steps", "2"]
    result = run_cli(train_args(corpus, run, *args), cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = export_hf(run, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 32
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # two steps from a fresh start: small logits
        assert_close_logits(load_full_model(run)[0](tokens), hf_logits(out, tokens), min_scale=0.1)
    half = export_hf(run, tmp_path / "bf16", dtype="bf16")  # `meshtrain export --dtype bf16`
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in read_weights(half).values()} == {torch.bfloat16}


@pytest.mark.multiproc
def test_fine_tuning_an_imported_model_exports_its_own_config(models, corpus, cli_env, tmp_path):
    """Train from a Qwen3 directory under TP 2, export: the model's own config.json and tokenizer
    files come back, and the first loss is the imported model's (not a fresh one's ~6.2)."""
    source = models["qwen3-tied"]
    run = tmp_path / "run"
    result = run_cli(
        train_args(corpus, run, "--model.init_from", f"hf:{source}", "--nproc", "2", "--parallel.tp", "2", model=())
        + ["--training.steps", "2", "--training.seq_len", "48"],
        cli_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = export_hf(run, tmp_path / "export")
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert (out / "tokenizer_config.json").read_text() == (source / "tokenizer_config.json").read_text()
    first = read_metrics(run)[0]["loss"]
    batch = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = hf_logits(source, batch)
    random_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(first - random_loss) < 0.5 * random_loss  # the imported weights' loss, not ln(512) = 6.2
    tokens = probe_tokens()
    with torch.no_grad():
        assert_close_logits(load_full_model(run)[0](tokens), hf_logits(out, tokens))


REFUSALS = [
    ("llama2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("llama2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters and rope_scaling disagree"),
    ("llama2", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama3.1", {"rope_parameters": {**VARIANTS["llama3.1"][1]["rope_scaling"], "beta_fast": 32}}, "beta_fast"),
    ("llama2", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ("mistral", {"sliding_window": 16}, "sliding_window 16"),
    ("mistral", {"attention_bias": True}, "attention_bias"),
    ("qwen2-tied", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2-tied", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("qwen3-tied", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3-tied", {"attention_dropout": 0.1}, "attention_dropout"),
    ("qwen3-tied", {"model_type": "deepseek_v3"}, "deepseek_v3' is not a family .* latent attention"),
    ("qwen3-tied", {"model_type": "gpt_oss"}, "gpt_oss' is not a family .* attention sinks"),
    # mixtures of experts: sizes that cannot hold, routing meshtrain does not do
    ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
    ("qwen3-moe", {"num_experts": 0}, "num_experts is 0: it must be a positive integer"),
    ("qwen3-moe", {"num_experts": 6}, "num_experts and num_local_experts disagree"),
    ("qwen3-moe", {"mlp_only_layers": [5]}, "mlp_only_layers is \\[5\\]: it must be a list of layer indices"),
    ("qwen3-moe", {"norm_topk_prob": "true"}, "norm_topk_prob is 'true'"),
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise 0.01"),
    ("mixtral", {"router_aux_loss_coef": -1}, "router_aux_loss_coef is -1"),
    ("qwen3-tied", {"intermediate_size": "96"}, "intermediate_size is '96'"),
    ("llama2", {"unknown_knob": 1}, "unknown_knob: not a llama field"),
    # mistyped values transformers refuses: "false" would read as true, a null epsilon as torch's own
    ("qwen2-tied", {"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false': it must be true or false"),
    ("llama2", {"rms_norm_eps": None}, "rms_norm_eps is None: it must be a positive number"),
    ("llama2", {"max_position_embeddings": None}, "max_position_embeddings is None: it must be a positive"),
    # numbers that reach NaN logits or a table no memory holds, silently or as a traceback
    ("llama3.1", {"rope_parameters": {**VARIANTS["llama3.1"][1]["rope_scaling"], "factor": 0}}, "factor is 0: it"),
    ("llama2", {"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "factor is '2': it must be a positive"),
    ("llama2", {"rope_parameters": {"rope_type": "linear", "factor": float("inf")}}, "factor is inf: it must be"),
    (
        "llama3.1",
        {"rope_parameters": {**VARIANTS["llama3.1"][1]["rope_scaling"], "low_freq_factor": 4.0}},
        "low_freq_factor must be below high_freq_factor",
    ),
    ("llama2", {"rope_theta": float("nan")}, "rope_theta is nan: it must be a positive number"),
    ("llama2", {"rms_norm_eps": float("inf")}, "rms_norm_eps is inf: it must be a finite number"),
    ("llama2", {"max_position_embeddings": 10**12}, "max_position_embeddings 1,000,000,000,000 is more positions"),
]


def test_a_mistral_config_without_sliding_window_has_transformers_default_window(models, tmp_path):
    """transformers reads a Mistral config.json without the key as a 4096-token window: longer
    contexts would attend differently there, so it is refused like a written window."""
    config = json.loads((models["mistral"] / "config.json").read_text())
    config.pop("sliding_window", None)
    for positions, refused in ((4096, False), (32768, True)):
        (tmp_path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": positions}))
        if refused:
            with pytest.raises(MeshtrainError, match="sliding_window 4096 is shorter than max_position_embeddings"):
                hf_model_args(tmp_path)
        else:
            assert hf_model_args(tmp_path).max_seq_len == 4096


def test_a_context_raised_past_config_json_must_fit_its_sliding_window(models, tmp_path):
    """model.max_seq_len may raise a pretrained model's context, but not past a sliding window that
    covered config.json's own context: past it transformers attends within the window. A model with
    no window (Llama) may be raised."""
    from meshtrain.config import load_config
    from meshtrain.job.model import model_args

    config = json.loads((models["mistral"] / "config.json").read_text())
    config.pop("sliding_window", None)  # transformers' 4096-token window
    (tmp_path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))

    def raised(directory, length: int):
        return model_args(load_config(overrides={"model.init_from": f"hf:{directory}", "model.max_seq_len": length}))

    assert raised(tmp_path, 4096).max_seq_len == 4096
    with pytest.raises(MeshtrainError, match="model.max_seq_len 8192 is longer than config.json's sliding_window 4096"):
        raised(tmp_path, 8192)
    llama = json.loads((models["llama2"] / "config.json").read_text())["max_position_embeddings"]
    assert raised(models["llama2"], 2 * llama).max_seq_len == 2 * llama


@pytest.mark.parametrize("variant, change, named", REFUSALS, ids=[r[2].split()[0] for r in REFUSALS])
def test_fields_meshtrain_cannot_compute_are_refused_by_name(variant, change, named, models, tmp_path):
    config = json.loads((models[variant] / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MeshtrainError, match=named.replace("(", r"\(")) as refusal:
        hf_model_args(tmp_path)
    assert "\n" not in str(refusal.value)


def test_refusals_reach_the_user_in_one_line(models, corpus, cli_env, tmp_path):
    """train, serve and generate share the import's refusal."""
    broken = tmp_path / "mistral"
    broken.mkdir()
    for f in models["mistral"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text()) | {"sliding_window": 16}
    (broken / "config.json").write_text(json.dumps(config))
    result = run_cli(train_args(corpus, tmp_path / "run", "--model.init_from", f"hf:{broken}", model=()), cli_env)
    assert_user_error(result, "sliding_window 16", "set sliding_window to null")
    result = run_cli(["generate", str(broken), "--prompt", "x", "--device", "cpu"], cli_env)
    assert_user_error(result, "sliding_window 16")
    # a shape key that contradicts the pretrained weights; an option the family has no place for
    args = train_args(corpus, tmp_path / "run", "--model.init_from", f"hf:{models['mistral']}", model=())
    assert_user_error(run_cli([*args, "--model.ffn_dim", "128"], cli_env), "model.ffn_dim = 128", "has 96")
    args = train_args(corpus, tmp_path / "run", "--model.qk_norm", "true")
    assert_user_error(run_cli(args, cli_env), "model.family = 'llama' has no qk_norm=True")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", [n for n in PRESETS if "." in n or n.startswith(("mistral", "qwen"))])
def test_published_presets_are_their_family_s_config(name):
    """Each preset written as its family's config.json reads back as itself."""
    args = PRESETS[name]
    config = args_to_config(args, "bfloat16", None, [])
    assert same_model(config_to_args(json.loads(json.dumps(config)), name), args)


def test_weights_the_config_does_not_declare_are_refused(models, tmp_path):
    """A q_proj bias in a Llama whose config says attention_bias false would be dropped silently."""
    from safetensors.torch import save_file

    directory = tmp_path / "llama"
    directory.mkdir()
    for f in models["llama2"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, directory / "model.safetensors")
    args = hf_model_args(directory)
    with pytest.raises(MeshtrainError, match="q_proj.bias"):
        load_hf_weights([Llama(args)], directory, args)
    # embeddings of another vocabulary than config.json's; a tied model holding a different lm_head
    del weights["model.layers.0.self_attn.q_proj.bias"]
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 8}))
    save_file(weights, directory / "model.safetensors")
    args = hf_model_args(directory)
    with pytest.raises(MeshtrainError, match=f"rows, but config.json's vocab_size is {config['vocab_size'] + 8}"):
        load_hf_weights([Llama(args)], directory, args)
    (directory / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
    save_file(weights, directory / "model.safetensors")
    args = hf_model_args(directory)
    with pytest.raises(MeshtrainError, match="holds an lm_head.weight that differs from them"):
        load_hf_weights([Llama(args)], directory, args)


def test_an_moe_checkpoint_missing_one_expert_is_refused_by_name(models, tmp_path):
    """Expert 5 of layer 0 left out of the file: its name, before any weight is used."""
    from safetensors.torch import save_file

    directory = tmp_path / "moe"
    shutil.copytree(models["qwen3-moe"], directory)
    weights = {}
    for file in directory.glob("*.safetensors"):
        weights |= load_file(file)
        file.unlink()
    (directory / "model.safetensors.index.json").unlink()
    del weights["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(weights, directory / "model.safetensors")
    args = hf_model_args(directory)
    with pytest.raises(MeshtrainError, match=r"has no model.layers.0.mlp.experts.5.up_proj.weight \(needed for"):
        load_hf_weights([Llama(args)], directory, args)


def test_a_long_context_model_is_served_with_a_bounded_cache(models, tmp_path):
    """A 128K-context import (Llama 3.1, Qwen 2.5) served without --max-context: the KV cache is
    sized for 8192 tokens a request, not the model's longest (hundreds of GiB at a real size)."""
    from meshtrain.model.kv_cache import kv_bytes_per_token
    from meshtrain.serve import CacheSettings, load_engine

    directory = tmp_path / "long"
    directory.mkdir()
    for f in models["qwen3-tied"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    config = json.loads((directory / "config.json").read_text()) | {"max_position_embeddings": 131072}
    (directory / "config.json").write_text(json.dumps(config))
    served, engine = load_engine(str(directory), max_batch=2, device="cpu")
    try:
        assert served.model.args.max_seq_len == 131072 and engine.max_context == 8192
        assert engine.cache.blocks * engine.cache.block_size == 2 * 8192
    finally:
        engine.close()
    # --kv-cache-gib, --block-size, --prefill-chunk and --no-prefix-caching each reach the engine
    per_token = kv_bytes_per_token(served.model)
    settings = CacheSettings(
        kv_cache_gib=3000 * per_token / 2**30, block_size=8, prefill_chunk=64, prefix_caching=False
    )
    _, engine = load_engine(str(directory), max_batch=2, max_context=2048, device="cpu", cache=settings)
    try:
        assert (engine.cache.blocks, engine.cache.block_size, engine.prefill_chunk) == (375, 8, 64)
        assert not engine.cache.prefix_caching
    finally:
        engine.close()
    with pytest.raises(MeshtrainError, match=r"^--kv-cache-gib .* holds 2047 tokens .* context of 2048: give at least"):
        load_engine(str(directory), max_context=2048, device="cpu", cache=CacheSettings(2047 * per_token / 2**30))


def copied(source: Path, out: Path) -> Path:
    out.mkdir()
    for f in source.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_a_directory_transformers_loads_as_another_model_is_refused(models, corpus, cli_env, tmp_path):
    """A stale index beside model.safetensors (transformers takes the file) and peft adapters beside
    the model (transformers with peft applies them) are refused by import, serve and train alike."""
    from meshtrain.serve.loading import load_served_model

    args = hf_model_args(models["llama2"])
    stale = copied(models["llama2"], tmp_path / "stale")
    index = {"weight_map": dict.fromkeys(load_file(stale / "model.safetensors"), "model.safetensors")}
    (stale / "model.safetensors.index.json").write_text(json.dumps(index))
    both = "holds both model.safetensors and model.safetensors.index.json: remove the stale one"
    with pytest.raises(MeshtrainError, match=both):
        hf_model_args(stale)
    with pytest.raises(MeshtrainError, match=both):
        load_hf_weights([Llama(args)], stale, args)

    adapted = copied(models["llama2"], tmp_path / "adapted")
    (adapted / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    beside = r"holds peft adapters \(adapter_config.json\) beside the model: merge them"
    for read in (hf_model_args, lambda d: load_hf_weights([Llama(args)], d, args)):
        with pytest.raises(MeshtrainError, match=beside) as refusal:
            read(adapted)
        assert "\n" not in str(refusal.value)
    with pytest.raises(MeshtrainError, match=beside):
        load_served_model(adapted, torch.device("cpu"), torch.float32)
    result = run_cli(train_args(corpus, tmp_path / "run", "--model.init_from", f"hf:{adapted}", model=()), cli_env)
    assert_user_error(result, "holds peft adapters (adapter_config.json)", "merge_and_unload")
    assert not (tmp_path / "run").exists()


def test_a_truncated_weight_file_is_one_line_naming_it(models, corpus, cli_env, tmp_path):
    """A download cut short: its tensors' bytes, or its header, end early. Import says which file, in
    one line, and train creates nothing."""
    args = hf_model_args(models["llama2"])
    cut = copied(models["llama2"], tmp_path / "cut")
    whole = (cut / "model.safetensors").read_bytes()
    for size in (len(whole) - 1000, 100):
        (cut / "model.safetensors").write_bytes(whole[:size])
        with pytest.raises(MeshtrainError, match=r"cut/model.safetensors cannot be read .*truncated") as refused:
            load_hf_weights([Llama(args)], cut, args)
        assert "\n" not in str(refused.value)
    result = run_cli(train_args(corpus, tmp_path / "run", "--model.init_from", f"hf:{cut}", model=()), cli_env)
    assert_user_error(result, "cut/model.safetensors cannot be read", "download or copy it again")
    assert not (tmp_path / "run").exists()


def test_an_index_lists_exactly_the_tensors_of_its_shards(models, tmp_path):
    """A tensor in a shard the index does not list would be loaded by transformers and never seen by
    meshtrain's check for weights it cannot place; one the index puts in a shard that lacks it, a bad
    weight_map or a field no index has are refused in one line."""
    from safetensors.torch import save_file

    source = models["llama3.1"]  # two shards and an index
    args = hf_model_args(source)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shard = load_file(source / first)
    name = next(iter(shard))

    def refused(directory: Path, message: str) -> None:
        with pytest.raises(MeshtrainError, match=message) as refusal:
            load_hf_weights([Llama(args)], directory, args)
        assert "\n" not in str(refusal.value)

    unlisted = copied(source, tmp_path / "unlisted")
    save_file(shard | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, unlisted / first)
    refused(unlisted, f"{first} holds model.layers.0.self_attn.q_proj.bias, which model.safetensors.index.json")
    missing = copied(source, tmp_path / "missing")
    save_file({k: v for k, v in shard.items() if k != name}, missing / first)
    refused(missing, f"places {name} in {first}, which does not hold it")
    for case, weight_map, message in (
        ("not-a-map", list(index["weight_map"]), "has no weight_map of tensor names to shard files"),
        ("not-a-file", index["weight_map"] | {name: 3}, f"weight_map's '{name}' is 3, not a shard file name"),
    ):
        directory = copied(source, tmp_path / case)
        (directory / "model.safetensors.index.json").write_text(json.dumps(index | {"weight_map": weight_map}))
        refused(directory, message)
    directory = copied(source, tmp_path / "extra-field")
    (directory / "model.safetensors.index.json").write_text(json.dumps(index | {"shards": 2}))
    refused(directory, "shards: not a field of a safetensors index")


def test_special_tokens_map_is_read_where_tokenizer_config_names_no_token(models, tmp_path):
    """transformers takes eos_token and bos_token from special_tokens_map.json where
    tokenizer_config.json has none; the two files naming different tokens are refused, and data
    prepare keeps the file with the tokenizer so that a run stops where its data ends."""
    from tokenizers import Tokenizer

    from meshtrain.data.tokenizer import begin_of_text, copy_tokenizer, end_of_text
    from meshtrain.errors import DataError

    tokenizer_file = models["llama2"] / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    turn_end = tokenizer.id_to_token(300)
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    special = {"eos_token": {"content": turn_end, "lstrip": False}, "bos_token": "<|endoftext|>"}
    (source / "special_tokens_map.json").write_text(json.dumps(special))
    assert end_of_text(tokenizer, source) == (turn_end, 300)
    assert begin_of_text(tokenizer, source) == "<|endoftext|>"
    assert end_tokens(source, tokenizer)[0] == turn_end
    kept = tmp_path / "data"
    copy_tokenizer(source / "tokenizer.json", kept)
    assert end_of_text(tokenizer, kept) == (turn_end, 300)

    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": turn_end}))  # the same token: read
    assert end_of_text(tokenizer, source) == (turn_end, 300)
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(DataError, match=f"eos_token is '<\\|endoftext\\|>' in tokenizer_config.json but '{turn_end}'"):
        end_of_text(tokenizer, source)
    with pytest.raises(DataError, match="eos_token is '<"):  # checked whichever token is asked for
        begin_of_text(tokenizer, source)
    (source / "tokenizer_config.json").write_text("{}")
    (source / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"lstrip": False}}))
    with pytest.raises(DataError, match=r"special_tokens_map.json: eos_token is \{'lstrip': False\}: it should be"):
        end_of_text(tokenizer, source)


def tokenizer_like(corpus: Path, out: Path, specials: list[str], prefix: str | None, config: dict):
    """The test tokenizer with a published model's special tokens, post-processor (`prefix`: the
    token its TemplateProcessing puts before a text; None: Qwen2's ByteLevel, which adds none) and
    tokenizer_config.json."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    tokenizer.add_special_tokens(specials)
    if prefix is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{prefix} $A",
            pair=f"{prefix} $A {prefix} $B",
            special_tokens=[(prefix, tokenizer.token_to_id(prefix))],
        )
    out.mkdir()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_file(str(out / "tokenizer.json"))


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]
LLAMA3 = {"add_bos_token": True, "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
QWEN2 = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>"}
MISTRAL = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>"}
PUBLISHED_TOKENIZERS = {
    "llama3": (LLAMA3_SPECIALS, "<|begin_of_text|>", LLAMA3),
    "qwen2": (["<|endoftext|>", "<|im_end|>"], None, QWEN2),
    "qwen2-no-flag": (["<|endoftext|>", "<|im_end|>"], None, {"eos_token": "<|im_end|>"}),
    "mistral": (["<s>", "</s>"], "<s>", MISTRAL),
}
FLAG_REFUSALS = {
    "eos-added-by-none": (
        ["<s>", "</s>"],
        "<s>",
        MISTRAL | {"add_eos_token": True},
        "add_eos_token is true but tokenizer.json's post-processor puts nothing after a text: set add_eos_token "
        "to false to match tokenizer.json",
    ),
    "bos-not-added": (
        LLAMA3_SPECIALS,
        "<|begin_of_text|>",
        LLAMA3 | {"add_bos_token": False},
        "add_bos_token is false but tokenizer.json's post-processor puts <|begin_of_text|> before a text: set "
        "add_bos_token to true",
    ),
    "bos-added-by-none": (
        ["<|endoftext|>", "<|im_end|>"],
        None,
        QWEN2 | {"add_bos_token": True},
        "add_bos_token is true but tokenizer.json's post-processor puts nothing before a text: set add_bos_token "
        "to false",
    ),
    "another-bos": (
        ["<s>", "</s>"],
        "<s>",
        MISTRAL | {"bos_token": "</s>"},
        "add_bos_token is true but tokenizer.json's post-processor puts <s> before a text, not bos_token </s>: make "
        "bos_token the token tokenizer.json puts there",
    ),
    "not-a-bool": (
        ["<s>", "</s>"],
        "<s>",
        MISTRAL | {"add_bos_token": "true"},
        "add_bos_token is 'true': it must be true or false",
    ),
}


@pytest.mark.parametrize("name", PUBLISHED_TOKENIZERS)
def test_published_add_bos_and_eos_flags_agree_with_their_post_processor(name, corpus, tmp_path):
    from meshtrain.data.tokenizer import begin_of_text, document_prefix, end_of_text

    specials, prefix, config = PUBLISHED_TOKENIZERS[name]
    tokenizer = tokenizer_like(corpus, tmp_path / name, specials, prefix, config)
    assert end_of_text(tokenizer, tmp_path / name)[0] == config["eos_token"]
    assert begin_of_text(tokenizer, tmp_path / name) == config.get("bos_token")
    assert document_prefix(tokenizer) == ([tokenizer.token_to_id(prefix)] if prefix else [])


@pytest.mark.parametrize("name", FLAG_REFUSALS)
def test_add_bos_and_eos_flags_that_contradict_the_post_processor_are_refused(name, corpus, tmp_path):
    """transformers 4's Llama and Gemma tokenizers rebuild the post-processor from these flags, which
    meshtrain follows from tokenizer.json: data prepare (and serve, generate, export) refuse to pick one."""
    from meshtrain.data import prepare
    from meshtrain.errors import DataError

    specials, prefix, config, message = FLAG_REFUSALS[name]
    tokenizer_like(corpus, tmp_path / "tokenizer", specials, prefix, config)
    (tmp_path / "a.txt").write_text("text to tokenize\n" * 20)
    with pytest.raises(DataError, match=f"tokenizer_config.json: {message}".replace("|", r"\|")) as refusal:
        prepare(
            [tmp_path / "a.txt"], tmp_path / "data", tokenizer=tmp_path / "tokenizer/tokenizer.json", progress=False
        )
    assert "\n" not in str(refusal.value)
    assert not (tmp_path / "data").exists()


IGNORED_FIELDS = {"architectures", "initializer_range", "transformers_version", "use_cache", "pretraining_tp"}


def test_every_config_json_field_past_its_bounds_is_refused_in_one_line(models, tmp_path_factory):
    """Each field of every family's config.json that meshtrain reads (nested RoPE parameters too),
    given a value of the wrong type, NaN, infinite, negative or huge, is refused in one line naming
    config.json: never a traceback of another kind, never imported as if nothing were wrong. The
    fields transformers keeps for itself (IGNORED_FIELDS: they change nothing computed) are not read."""
    import math

    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    cases = [
        (name, path)
        for name in sorted(models)
        for path in field_paths(read_config(models[name]))
        if path[0] not in IGNORED_FIELDS and not isinstance(path[-1], int)  # a list: the field as a whole
    ]
    bad = st.sampled_from([math.nan, math.inf, -math.inf, -1, -0.5, 1e300, 2**70, [1, "x"], {"a": "b"}])
    edited = tmp_path_factory.mktemp("edited")

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(cases), bad)
    def refused(case, value):
        name, path = case
        assume(not (path == ("pad_token_id",) and value == -1))  # Llama 2's spelling of "no padding token"
        (edited / "config.json").write_text(json.dumps(with_field(read_config(models[name]), path, value)))
        with pytest.raises(MeshtrainError) as refusal:
            hf_model_args(edited)
        assert "\n" not in str(refusal.value) and "config.json" in str(refusal.value), (name, path, value)

    refused()


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())
