"""Hugging Face export / import round trip, offline, from a sharded (ZeRO-3) training run."""

import json
import shutil

import pytest
import torch

from conftest import assert_user_error, greedy_by_recomputation, read_metrics, run_cli, train_args
from meshtrain.interop import export_hf, hf_model_args, load_hf_weights
from meshtrain.interop.hf import load_full_model
from meshtrain.model import Llama

# GQA (4 query heads, 2 KV heads) and a vocabulary padded from 512 to 576 rows.
MODEL = ["--model.n_layers", "2", "--model.vocab_multiple", "96"]


@pytest.fixture(scope="module")
def trained(corpus, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf-run")
    result = run_cli(
        train_args(corpus, run_dir, *MODEL, "--nproc", "2", "--parallel.zero", "3", "--checkpoint.every", "10"), cli_env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path_factory.mktemp("hf") / "export"
    result = run_cli(["export", str(run_dir), "--out", str(out)], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, out


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_exported_directory_is_a_complete_hf_llama(trained):
    _, out = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 512
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name


def test_transformers_gives_the_same_logits_and_greedy_tokens(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = trained
    ours, args, _ = load_full_model(run_dir)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours(tokens)[..., : args.vocab_size]
        theirs = hf(tokens).logits
    assert (mine - theirs).abs().max().item() <= 1e-4

    prompt = tokens[0, :8].tolist()
    greedy = greedy_by_recomputation(ours.eval(), prompt, 12)
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 8:].tolist()
    assert greedy == hf_out

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    from tokenizers import Tokenizer

    text = "def f(x):\n    return x + 1\n"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(run_dir / "tokenizer.json")).encode(text).ids


def test_export_from_checkpoint_equals_export_from_final_weights(trained, tmp_path):
    run_dir, out = trained
    final_only = tmp_path / "final"
    final_only.mkdir()
    for name in ("model.safetensors", "model.json", "tokenizer.json"):
        shutil.copy(run_dir / name, final_only / name)
    other = export_hf(final_only, tmp_path / "export")
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_damaged_final_weights_or_model_json_are_one_line(trained, tmp_path):
    """Export of a run's final weights: a truncated model.safetensors, a model.json that is not JSON,
    has an unknown key, or is missing, each named in one line (they were tracebacks)."""
    from meshtrain.errors import CheckpointError

    run_dir, _ = trained
    final = tmp_path / "final"
    final.mkdir()
    for name in ("model.safetensors", "model.json", "tokenizer.json"):
        shutil.copy(run_dir / name, final / name)
    shape = (final / "model.json").read_text()
    (final / "model.safetensors").write_bytes((run_dir / "model.safetensors").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read .* truncated or not a safetensors"):
        export_hf(final, tmp_path / "a")
    shutil.copy(run_dir / "model.safetensors", final / "model.safetensors")
    for text, named in (("{", "is not valid JSON"), ('{"dimm": 3}', "dimm"), (None, "model.json is missing")):
        if text is None:
            (final / "model.json").unlink()
        else:
            (final / "model.json").write_text(text)
        with pytest.raises(Exception, match=named) as refused:
            export_hf(final, tmp_path / "b")
        assert "\n" not in str(refused.value) and "model.json" in str(refused.value)
    (final / "model.json").write_text(shape)
    assert export_hf(final, tmp_path / "c").is_dir()


def test_large_exports_are_split_into_indexed_shards(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, out = trained
    split = export_hf(run_dir, tmp_path / "split", max_shard_size="200KB")
    index = json.loads((split / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (split / "model.safetensors").exists()
    a = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, torch_dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(split, local_files_only=True, torch_dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    args = hf_model_args(split, vocab_multiple=96)
    model = Llama(args)
    load_hf_weights([model], split, args)  # import reads the index too


def test_import_gives_identical_logits(trained):
    run_dir, out = trained
    ours, args, _ = load_full_model(run_dir)
    imported_args = hf_model_args(out, vocab_multiple=96)
    assert imported_args == args
    fresh = Llama(imported_args)
    fresh.init_weights(seed=123)
    load_hf_weights([fresh], out, imported_args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(fresh(tokens)[..., :512], ours(tokens)[..., :512])


@pytest.mark.parametrize(
    "layout", [["--parallel.tp", "2", "--parallel.zero", "3"], []], ids=["tp2-zero3", "ddp2"]
)  # DDP wraps the model: its parameter names carry "module."
def test_training_continues_from_a_hf_directory(layout, trained, corpus, cli_env, tmp_path):
    run_dir, out = trained
    args = train_args(corpus, tmp_path, "--model.init_from", f"hf:{out}", "--nproc", "2", *layout, model=())
    result = run_cli([*args, "--training.steps", "2"], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "initialised from hf:" in result.stdout
    trained_loss = read_metrics(run_dir)[-1]["loss"]
    first = read_metrics(tmp_path)[0]["loss"]
    assert first < trained_loss + 0.3  # starts where the exported model ended, not from scratch (~6.2)


def test_broken_hf_directories_are_clear_errors(trained, corpus, cli_env, tmp_path):
    _, out = trained
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    result = run_cli(train_args(corpus, tmp_path / "run", "--model.init_from", f"hf:{broken}", model=()), cli_env)
    assert_user_error(result, "model.init_from", "model.layers.1.mlp.up_proj.weight")
    result = run_cli(train_args(corpus, tmp_path / "run", "--model.init_from", "hf:/nonexistent", model=()), cli_env)
    assert_user_error(result, "model.init_from")


def test_init_from_refuses_data_tokenized_with_another_tokenizer(trained, cli_env, tmp_path):
    from meshtrain.data import prepare

    _, out = trained
    texts = tmp_path / "a.txt"
    texts.write_text("fine-tuning text that another tokenizer cut up\n" * 200)
    other = tmp_path / "other-data"
    prepare([texts], other, vocab_size=300, val_fraction=0.0, progress=False)
    for launcher in ([], ["--nproc", "2"]):
        result = run_cli(
            [*train_args(other, tmp_path / "run", "--model.init_from", f"hf:{out}", model=()), *launcher], cli_env
        )
        assert_user_error(result, "another tokenizer", "--tokenizer")
    assert not (tmp_path / "run").exists()


def test_export_of_a_hugging_face_directory_is_refused_in_one_line(tmp_path):
    """export takes a run or a checkpoint: a Hugging Face directory (an earlier export) holds no
    model.json, which the export read after a traceback-worthy miss."""
    from meshtrain.errors import MeshtrainError
    from meshtrain.interop.weights import run_weights

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(MeshtrainError, match="is a Hugging Face directory: export takes a meshtrain run or checkpoint"):
        run_weights(tmp_path)


def test_a_checkpoint_dir_outside_the_run_is_where_export_serve_and_generate_look(corpus, cli_env, tmp_path):
    """A run saving to a checkpoint.dir outside run.dir: its weights were looked for in <run>/checkpoints
    only, so the run directory gave the step-2 model.safetensors while the resumed run's step-3
    checkpoint sat in checkpoint.dir; and a checkpoint there passed directly had its tokenizer looked for
    two levels up. The run's config.toml leads to its checkpoints; a checkpoint finds its run by the
    run.dir its train_state.json records, and one that records none outside its run is refused in one line."""
    from meshtrain.checkpoint import MARKER, TRAIN_STATE, crc32
    from meshtrain.errors import MeshtrainError
    from meshtrain.interop.weights import run_weights

    def record_run_dir(ckpt, run_dir):
        """The train state with (or, None, without) run_dir, committed again."""
        state = {k: v for k, v in json.loads((ckpt / TRAIN_STATE).read_text()).items() if k != "run_dir"}
        (ckpt / TRAIN_STATE).write_text(json.dumps(state | ({"run_dir": str(run_dir)} if run_dir else {})))
        marker = json.loads((ckpt / MARKER).read_text())
        marker["files"][TRAIN_STATE] = {
            "bytes": (ckpt / TRAIN_STATE).stat().st_size,
            "crc32": crc32(ckpt / TRAIN_STATE),
        }
        (ckpt / MARKER).write_text(json.dumps(marker))

    run, root = tmp_path / "run", tmp_path / "scratch" / "ck"
    args = train_args(corpus, run, *MODEL, "--checkpoint.dir", str(root), "--checkpoint.every", "2")
    for extra in (["--training.steps", "2"], ["--training.steps", "4", "--training.stop_at_step", "3"]):
        result = run_cli([*args, *extra], cli_env)
        assert result.returncode == 0, result.stderr[-3000:]
    step3 = root / "step_00000003"
    assert (run / "model.safetensors").is_file() and not (run / "checkpoints").exists()
    assert run_weights(run) == (step3, run)  # not the step-2 model.safetensors

    record_run_dir(step3, run)
    assert run_weights(step3) == (step3, run)
    result = run_cli(["export", str(step3), "--out", str(tmp_path / "hf")], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    record_run_dir(step3, None)  # saved before run_dir was recorded
    with pytest.raises(MeshtrainError, match=r"no run directory found for checkpoint .*pass the run directory"):
        run_weights(step3)


def test_the_run_of_a_checkpoint_is_the_one_whose_checkpoints_are_there(tmp_path):
    """export/serve/generate read a checkpoint's tokenizer and record from its run: the directory
    holding it, moved or copied, before a recorded run.dir that may now be another run; the recorded
    one where checkpoint.dir lay outside the run. A moved run whose relative checkpoint.dir no longer
    resolves still gives its final weights."""
    from meshtrain.checkpoint import MARKER, TRAIN_STATE
    from meshtrain.interop.weights import run_of, run_weights

    def run(path, checkpoint_dir=None, run_dir=None):
        path.mkdir(parents=True)
        lines = [f"[checkpoint]\ndir = {str(checkpoint_dir)!r}\n"] if checkpoint_dir else []
        lines += [f"[run]\ndir = {str(run_dir)!r}\n"] if run_dir else []
        (path / "config.toml").write_text("".join(lines))
        return path

    def checkpoint(path, run_dir):
        path.mkdir(parents=True)
        (path / TRAIN_STATE).write_text(json.dumps({"step": 2, "run_dir": str(run_dir)}))
        (path / MARKER).write_text("{}")
        return path

    renamed = run(tmp_path / "exp-v1")  # trained as exp, renamed; a new run took the name
    newer = run(tmp_path / "exp")
    assert run_of(checkpoint(renamed / "checkpoints" / "step_00000002", newer)) == renamed
    outside = run(tmp_path / "r1", checkpoint_dir=tmp_path / "scratch")
    assert run_of(checkpoint(tmp_path / "scratch" / "step_00000003", outside)) == outside
    moved = run(tmp_path / "moved" / "a", checkpoint_dir="ckpts/a", run_dir="runs/a")
    (moved / "model.safetensors").write_bytes(b"")
    (moved / "model.json").write_text("{}")
    assert run_weights(moved) == (None, moved)


def test_an_export_renders_the_chat_templates_bos_token_as_training_did(corpus, tmp_path):
    """A run whose tokenizer has no begin-of-text token (meshtrain's own BPE) rendered a template's
    `{{ bos_token }}` as '' in its fine-tuning data (and `serve` renders it so): the export's tokenizer
    has no bos_token either, so transformers' apply_chat_template gives the ids training saw, not an
    <|endoftext|> before the prompt. config.json still names an id (the EOS's, GPT-2's use)."""
    import numpy as np
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from meshtrain.data import prepare
    from meshtrain.data.prepare import ChatOptions
    from meshtrain.data.tokenizer import copy_tokenizer
    from meshtrain.interop.weights import save_model
    from meshtrain.model import ModelArgs

    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{{ eos_token if m['role'] == 'assistant' else '' }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    messages = [{"role": "user", "content": "red cat"}, {"role": "assistant", "content": "cat red"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    data, run = tmp_path / "data", tmp_path / "run"
    options = {"val_fraction": 0, "progress": False, "workers": 1, "chat": ChatOptions(template)}
    manifest = prepare([tmp_path / "chat.jsonl"], data, tokenizer=corpus / "tokenizer.json", **options)
    trained_on = [
        int(t) for f, a, n in manifest["splits"]["train"] for t in np.fromfile(data / f, manifest["dtype"])[a : a + n]
    ]
    run.mkdir()
    copy_tokenizer(data / "tokenizer.json", run, data / "chat_template.jinja")  # as training keeps them
    vocab = Tokenizer.from_file(str(run / "tokenizer.json")).get_vocab_size()
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=vocab, max_seq_len=64)
    model = Llama(args)
    model.init_weights(0)
    save_model(model.state_dict(), args, run)

    out = export_hf(run, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    rendered = hf.apply_chat_template(messages, tokenize=False)
    assert not rendered.startswith("<|endoftext|>") and rendered.startswith("<|user|>")
    assert hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == trained_on
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == hf.convert_tokens_to_ids("<|endoftext|>")
