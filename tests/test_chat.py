"""Chat fine-tuning: conversations rendered with the serving template and masked to the assistant's
answers, a token-weighted global loss that is the same on every layout, and the whole path from a
pretrained model to a chat endpoint answering the openai client."""

import hashlib
import json
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same_run, assert_user_error, read_metrics, run_cli, train_args, train_together
from examples.word_task import TASKS, WORDS, answer, ask, conversations, split
from meshtrain.config import load_config
from meshtrain.data import prepare
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, conversation, tokenize_conversations
from meshtrain.data.loader import Blend, Dataset
from meshtrain.data.prepare import ChatOptions
from meshtrain.data.tokenizer import end_of_text, load_tokenizer
from meshtrain.data.windows import IGNORE_INDEX
from meshtrain.errors import DataError
from meshtrain.job.model import model_args
from meshtrain.model import Llama
from meshtrain.train.build import build as build_state

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return load_tokenizer(corpus / "tokenizer.json")


@pytest.mark.parametrize("source", [DEFAULT_CHAT_TEMPLATE, CHATML], ids=["default", "chatml"])
def test_the_targets_are_each_answer_and_its_end_of_turn(source, tokenizer):
    eos, _ = end_of_text(tokenizer)
    template = ChatTemplate(source, eos)
    messages = [
        {"role": "system", "content": "Reverse the words."},
        {"role": "user", "content": "red cat"},
        {"role": "assistant", "content": "cat red"},
        {"role": "user", "content": "sun moon star"},
        {"role": "assistant", "content": "star moon sun"},
    ]
    [(ids, mask)] = tokenize_conversations(tokenizer, template, [(messages, "row 1")], "assistant")
    assert ids == tokenizer.encode(template.render(messages), add_special_tokens=False).ids
    targets = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    # a turn ends with the end-of-text token (default), or the template's own end marker and newline
    end = eos if source == DEFAULT_CHAT_TEMPLATE else "<|im_end|>\n"
    assert targets == f"cat red{end}star moon sun{end}"
    [(_, every)] = tokenize_conversations(tokenizer, template, [(messages, "row 1")], "all")
    assert all(every)
    # OpenAI fine-tuning's per-answer weight: an answer of weight 0 is context, not a target
    weighted = conversation({"messages": [*messages[:2], {**messages[2], "weight": 0}, *messages[3:]]}, "row 1")
    [(same_ids, weighted_mask)] = tokenize_conversations(tokenizer, template, [(weighted, "row 1")], "assistant")
    assert same_ids == ids
    assert tokenizer.decode([i for i, m in zip(ids, weighted_mask) if m], skip_special_tokens=False) == (
        f"star moon sun{end}"
    )


@pytest.fixture(scope="module")
def chat_rows():
    """Conversations of 1-4 words, with and without a system message, some multi-turn, some as
    prompt/completion pairs: sequences pack different numbers of targets."""
    rng, rows = random.Random(0), []
    for i in range(600):
        task = rng.choice(list(TASKS))
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
        if i % 7 == 0:
            rows.append({"prompt": " ".join(words), "completion": " ".join(words)})
            continue
        messages = [*ask(task, words, system=i % 2 == 0), {"role": "assistant", "content": answer(task, words)}]
        if i % 5 == 0:
            more = [rng.choice(WORDS) for _ in range(2)]
            messages += [
                {"role": "user", "content": " ".join(more)},
                {"role": "assistant", "content": answer(task, more)},
            ]
        rows.append({"messages": messages})
    return rows


@pytest.fixture(scope="module")
def chat_data(chat_rows, corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    write_jsonl(root / "chat.jsonl", chat_rows)
    prepare(
        [root / "chat.jsonl"],
        root / "data",
        tokenizer=corpus / "tokenizer.json",
        val_fraction=0.05,
        progress=False,
        chat=ChatOptions(DEFAULT_CHAT_TEMPLATE),
    )
    return root / "data"


def test_conversations_are_packed_whole_and_their_targets_counted(chat_data, chat_rows, tokenizer):
    dataset = Dataset(chat_data, 128)
    train = dataset.train
    assert train.too_long == 0 and train.conversations == dataset.manifest["documents"]["train"]
    assert sum(len(seq) for seq in train.sequences) == train.conversations
    assert max(len(seq) for seq in train.sequences) > 1  # packed
    eos = tokenizer.token_to_id(end_of_text(tokenizer)[0])
    for w in range(len(train)):
        tokens, mask = train.window(w)
        used = sum(length for _, length in train.sequences[w])
        assert used <= 129 and (tokens[used:] == eos).all() and not mask[used:].any()
        # every conversation starts with a role marker: none was cut
        text = tokenizer.decode(tokens[:used].tolist(), skip_special_tokens=False)
        assert text.startswith("<|") and text.count("<|assistant|>") >= len(train.sequences[w])
        assert train.targets_in(w) == int(mask[1:].sum())
    assert sum(int(train.window(w)[1].sum()) for w in range(len(train))) == dataset.manifest["target_tokens"]
    # a shorter sequence leaves the longest conversations out, counted
    short = Dataset(chat_data, 48).train
    assert short.too_long > 0 and short.conversations + short.too_long == train.conversations


def prepared_tokens(out) -> list[int]:
    """A prepared train split as one list of ids, its segments in order."""
    manifest = json.loads((out / "manifest.json").read_text())
    return [
        int(t)
        for f, a, n in manifest["splits"]["train"]
        for t in np.fromfile(out / f, dtype=manifest["dtype"])[a : a + n]
    ]


LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def llama3_like_tokenizer(corpus, directory):
    """The test corpus's BPE as a Llama 3 tokenizer is made: a post-processor that adds
    <|begin_of_text|>, and a tokenizer_config.json naming it, the end of a turn and a chat template
    that writes bos_token."""
    from tokenizers import processors

    tok = load_tokenizer(corpus / "tokenizer.json")
    tok.add_special_tokens(["<|begin_of_text|>", "<|start|>", "<|eot|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "chat_template": LLAMA3_LIKE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_configured_token_outside_the_vocabulary_is_refused(corpus, tmp_path):
    """tokenizer_config.json's eos_token is where turns end and generation stops: one the tokenizer does
    not have is refused, never replaced by a guessed end-of-text token."""
    from meshtrain.data.tokenizer import begin_of_text

    directory = llama3_like_tokenizer(corpus, tmp_path / "tok")
    tok = load_tokenizer(directory / "tokenizer.json")
    assert end_of_text(tok, directory) == ("<|eot|>", tok.token_to_id("<|eot|>"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=re.escape("eos_token '<|im_end|>' is not a token of the tokenizer beside it")):
        end_of_text(tok, directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": {"content": "<s>"}}))
    with pytest.raises(DataError, match="bos_token '<s>' is not a token"):
        begin_of_text(tok, directory)


def test_a_run_keeps_its_tokenizers_bos_and_end_of_turn_for_serve_and_export(corpus, cli_env, tmp_path):
    """A model trained from scratch on chat rows prepared with a Llama-3-like tokenizer: the data and
    the run keep its tokenizer_config.json, so the served and the exported model (transformers'
    apply_chat_template) render prompts with its <|begin_of_text|> and stop at its <|eot|>."""
    from transformers import AutoTokenizer

    from meshtrain.serve.loading import load_served_model

    model_dir = llama3_like_tokenizer(corpus, tmp_path / "model")
    rows = [
        {"messages": [{"role": "user", "content": f"word {i}"}, {"role": "assistant", "content": "ok"}]}
        for i in range(64)
    ]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    prepare(
        [tmp_path / "chat.jsonl"],
        data,
        tokenizer=model_dir / "tokenizer.json",
        val_fraction=0,
        progress=False,
        chat=ChatOptions(LLAMA3_LIKE),
    )
    result = run_cli(train_args(data, run, "--training.steps", "2"), cli_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (data / "tokenizer_config.json").is_file() and (run / "tokenizer_config.json").is_file()
    served = load_served_model(run, torch.device("cpu"), torch.float32)
    eot = served.tokenizer.token_to_id("<|eot|>")
    assert served.bos_token == "<|begin_of_text|>" and eot in served.eos_ids
    assert run_cli(["export", str(run), "--out", str(out)], cli_env).returncode == 0
    messages = rows[0]["messages"][:1]
    ids = AutoTokenizer.from_pretrained(out).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert ids == served.prompt_ids(served.render_chat(messages), chat=True) and ids[0] == served.tokenizer.token_to_id(
        "<|begin_of_text|>"
    )
    assert ids == prepared_tokens(data)[: len(ids)]  # the training row's start


def test_a_tokenizer_that_adds_a_bos_gets_it_once_in_training_data_and_served_prompts(corpus, tmp_path):
    """A Llama-3-like tokenizer (its post-processor adds <|begin_of_text|>, its chat template writes
    bos_token): each prepared text document and chat row begins with one BOS, and the server's
    completion and chat prompts are the same ids transformers makes (tokenizer(text) and
    apply_chat_template): the model is served the start it was fine-tuned on."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from meshtrain.serve.app import _encode
    from meshtrain.serve.loading import ServedModel

    model_dir = llama3_like_tokenizer(corpus, tmp_path / "model")
    tok = load_tokenizer(model_dir / "tokenizer.json")
    bos = tok.token_to_id("<|begin_of_text|>")
    hf = AutoTokenizer.from_pretrained(model_dir)

    texts = ["def f(x):\n    return x\n", "import os\nprint(os.sep)\n"]
    write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    manifest = prepare(
        [tmp_path / "docs.jsonl"],
        tmp_path / "text",
        tokenizer=model_dir / "tokenizer.json",
        val_fraction=0,
        progress=False,
    )
    eot = tok.token_to_id("<|eot|>")
    assert manifest["eos_id"] == eot and manifest["document_prefix"] == [bos]
    stream = prepared_tokens(tmp_path / "text")
    assert stream == [i for t in texts for i in [*hf(t)["input_ids"], eot]]

    messages = [{"role": "user", "content": "red cat"}, {"role": "assistant", "content": "cat red"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    prepare(
        [tmp_path / "chat.jsonl"],
        tmp_path / "chat",
        tokenizer=model_dir / "tokenizer.json",
        val_fraction=0,
        progress=False,
        chat=ChatOptions(LLAMA3_LIKE),
    )
    row = prepared_tokens(tmp_path / "chat")
    assert row == hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert row.count(bos) == 1 and row[0] == bos

    served = ServedModel("m", None, tok, [eot], "<|eot|>", LLAMA3_LIKE, bos_token="<|begin_of_text|>")
    prompt = _encode(served, served.render_chat(messages[:1]), chat=True)
    expected = hf.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True, return_dict=True)
    assert prompt == expected["input_ids"] and prompt.count(bos) == 1
    assert _encode(served, texts[0], chat=False) == hf(texts[0])["input_ids"]
    # a post-processor that also ends a text (BERT's [SEP] style): a prompt is a document's start
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|eot|>", special_tokens=[("<|begin_of_text|>", bos), ("<|eot|>", eot)]
    )
    ended = ServedModel("m", None, tok, [eot], "<|eot|>", LLAMA3_LIKE, bos_token="<|begin_of_text|>")
    assert _encode(ended, texts[0], chat=False) == [bos, *tok.encode(texts[0], add_special_tokens=False).ids]


def test_the_loss_is_the_mean_over_target_tokens_of_the_whole_batch():
    """Two micro-batches whose sequences hold 3, 11, 16 and 1 targets: the step's loss and gradients
    are those of the mean over the 31 targets (not the mean of per-sequence or per-micro-batch means)."""
    cfg = load_config(
        None,
        [
            *"--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.ffn_dim 128".split(),
            *"--model.vocab_size 256 --model.max_seq_len 32 --training.seq_len 16".split(),
            *"--training.global_batch_size 4 --training.micro_batch_size 2 --training.grad_clip 0".split(),
            *"--training.dtype fp32".split(),
        ],
    )
    state = build_state(cfg, with_data=False)
    model = state.model.parts[0]
    ref = Llama(model_args(cfg))
    ref.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 256, (4, 16), generator=gen)
    targets = torch.randint(0, 256, (4, 16), generator=gen)
    for row, keep in enumerate([3, 11, 16, 1]):
        targets[row, torch.randperm(16, generator=gen)[keep:]] = IGNORE_INDEX
    logits = ref(inputs)
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    expected = per_token.sum() / 31
    expected.backward()
    loss, _, _ = state.step(inputs, targets, 31)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    mean_of_means = torch.stack([per_token.view(4, 16)[r][targets[r] != IGNORE_INDEX].mean() for r in range(4)])
    assert abs(mean_of_means.mean() - expected) > 1e-3  # the test can tell the two apart


CHAT_RUN = [
    *("--training.seq_len", "128", "--model.max_seq_len", "128"),
    *("--training.micro_batch_size", "2", "--training.steps", "4"),
]
CHAT_LAYOUTS = {
    "ddp2": ["--nproc", "2"],
    "zero3-2": ["--nproc", "2", "--parallel.zero", "3"],
    "tp2": ["--nproc", "2", "--parallel.tp", "2"],
    "pp2": ["--nproc", "2", "--parallel.pp", "2", "--model.n_layers", "4"],
}


@pytest.fixture(scope="module")
def chat_reference(chat_data, cli_env, tmp_path_factory):
    runs = {}

    def get(n_layers: str):
        if n_layers not in runs:
            run_dir = tmp_path_factory.mktemp(f"chat-reference-{n_layers}")
            result = run_cli(train_args(chat_data, run_dir, *CHAT_RUN, "--model.n_layers", n_layers), cli_env)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[n_layers] = run_dir
        return runs[n_layers]

    return get


def layers_of(extra: list[str]) -> str:
    return extra[extra.index("--model.n_layers") + 1] if "--model.n_layers" in extra else "2"


@pytest.fixture(scope="module")
def chat_layout_runs(chat_data, cli_env, tmp_path_factory):
    """The run dir of each of CHAT_LAYOUTS, all four trained in one 2-process launch (conftest.train_together)."""
    dirs = {name: tmp_path_factory.mktemp(f"chat-{name}") for name in CHAT_LAYOUTS}
    args = []
    for name, extra in CHAT_LAYOUTS.items():
        assert extra[:2] == ["--nproc", "2"]
        args.append(train_args(chat_data, dirs[name], *CHAT_RUN, "--model.n_layers", layers_of(extra), *extra[2:]))
    train_together(args, 2, cli_env)
    return dirs


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CHAT_LAYOUTS))
def test_masked_loss_is_the_same_on_every_layout(name, chat_layout_runs, chat_reference):
    run_dir = chat_layout_runs[name]
    reference = chat_reference(layers_of(CHAT_LAYOUTS[name]))
    assert_same_run(run_dir, reference)
    metrics = read_metrics(run_dir)
    assert all(0 < m["target_tokens"] < 8 * 128 for m in metrics)  # the mask is in force
    assert (run_dir / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE


@pytest.mark.parametrize(
    "rows, extra, fragments",
    [
        ([{"text": "plain"}], [], ['no "messages" list', "leave out --format chat"]),
        ([{"messages": [{"role": "tool", "content": "x"}]}], [], ["message 1 has role 'tool'", "system, user"]),
        ([{"messages": [{"role": "user", "content": "hi"}]}], [], ["no assistant message", "--chat-targets all"]),
        ([{"prompt": "hi"}], [], ['"prompt" but no string "completion"']),
        ([{"messages": [{"role": "user", "content": 3}]}], [], ["message 1 (user) has no string content"]),
        (None, [], ["plain text", "--format chat"]),
        ([{"prompt": "a b", "completion": "b a"}], ["--max-tokens", "3"], ["all 1 conversations", "--max-tokens 3"]),
        ([{"messages": [{"role": "user", "content": "hi", "name": "al"}]}], [], ["message 1 has 'name'", "keys"]),
        (
            [{"messages": [{"role": "assistant", "content": "a"}], "system": "be brief"}],
            [],
            ["has 'system', which meshtrain cannot use beside 'messages'"],
        ),
        ([{"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]}], [], ["weight 0.5", "0 (not"]),
        ([{"messages": [{"role": "assistant", "content": "a", "weight": 0}]}], [], ["no assistant message (of weight"]),
        ([{"messages": [{"role": "assistant", "content": "a", "weight": 0}]}], ["--chat-targets", "all"], ["weight 0"]),
    ],
    ids=["plain-jsonl", "role", "no-answer", "no-completion", "content", "txt", "too-long"]
    + ["unknown-key", "unknown-row-key", "weight-value", "all-weight-0", "weight-0-all-targets"],
)
def test_bad_chat_data_gets_one_line(rows, extra, fragments, corpus, cli_env, tmp_path):
    if rows is None:
        source = tmp_path / "notes.txt"
        source.write_text("just text")
    else:
        source = tmp_path / "rows.jsonl"
        write_jsonl(source, rows)
    args = ["data", "prepare", "--format", "chat", "--input", str(source), "--out", str(tmp_path / "out")]
    result = run_cli([*args, "--tokenizer", str(corpus / "tokenizer.json"), *extra], cli_env)
    assert_user_error(result, *fragments)
    if rows is not None and "messages" in json.dumps(rows):
        assert ":1" in result.stderr  # the line is named
    assert not (tmp_path / "out").exists()
    # only a finished unit is kept, to resume from: the one whose every conversation was too long
    assert (tmp_path / ".out.partial").exists() == ("--max-tokens" in extra)


def test_a_malformed_tokenizer_config_is_named_in_one_line(tmp_path):
    from meshtrain.data.chat import template_of

    config = tmp_path / "tokenizer_config.json"
    for text, problem in (('{"chat_template": ', "is not valid JSON"), ("[1, 2]", "is not a JSON object")):
        config.write_text(text)
        with pytest.raises(DataError) as refused:
            template_of(tmp_path)
        assert f"{config} {problem}" in str(refused.value) and "fix or remove it" in str(refused.value)
        assert "\n" not in str(refused.value)
    config.write_bytes(b'{"chat_template": "\xff"}')
    with pytest.raises(DataError, match="is not valid JSON"):
        template_of(tmp_path)


def test_chat_options_without_format_chat_are_refused(corpus, cli_env, tmp_path):
    for option in (["--chat-targets", "all"], ["--max-tokens", "9"], ["--chat-template", "t.jinja"]):
        result = run_cli(["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "x"), *option], cli_env)
        assert_user_error(result, option[0], "--format chat")


def test_conversations_longer_than_the_sequence_are_counted_and_left_out(chat_data, cli_env, tmp_path):
    result = run_cli(train_args(chat_data, tmp_path, "--training.seq_len", "48", "--training.steps", "1"), cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "longer than training.seq_len + 1 = 49 tokens and are left out" in result.stdout + result.stderr
    result = run_cli(train_args(chat_data, tmp_path / "b", "--training.seq_len", "16"), cli_env)
    assert_user_error(result, "longer than training.seq_len + 1 = 17", "raise training.seq_len")


# --- end to end: pretrained model -> chat fine-tune -> export -> serve -> openai client ---------

E2E_MODEL = [
    *"--model.dim 128 --model.n_layers 4 --model.n_heads 4 --model.n_kv_heads 2 --model.ffn_dim 384".split(),
    *"--model.max_seq_len 128 --training.seq_len 128 --training.global_batch_size 16".split(),
    *"--training.micro_batch_size 16 --run.sample_prompt= --run.tensorboard false --data.corpus=".split(),
    *"--training.dtype fp32".split(),  # what is learned, the same on every CPU (and no arithmetic probe)
]


def greedy_answers(client, model: str, held) -> list:
    out = []
    for words in held:
        for task in TASKS:
            reply = client.chat.completions.create(
                model=model, messages=ask(task, words), temperature=0, max_tokens=16
            ).choices[0]
            out.append((reply.message.content, reply.finish_reason, answer(task, words)))
    return out


def scores_of(directory, cli_env, held) -> list:
    """Greedy answers to the held-out requests through the openai client and `meshtrain serve`."""
    from openai import OpenAI
    from test_serve import start_server

    proc, url = start_server(directory, cli_env, "--max-batch", "8")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        return greedy_answers(client, directory.name, held)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def exact(rows) -> float:
    return sum(got == want for got, _, want in rows) / len(rows)


@pytest.fixture(scope="module")
def pretrained(corpus, cli_env, tmp_path_factory):
    """A "pretrained" model (the corpus, exported to the Hugging Face format) and chat data tokenized
    with its tokenizer (and so its template)."""
    _, trained = split()
    tmp_path = tmp_path_factory.mktemp("pretrained")
    pretrained, base = tmp_path / "pretrained", tmp_path / "base-hf"
    run = ["train", "--data.path", str(corpus), "--run.dir", str(pretrained), *E2E_MODEL, "--training.steps", "30"]
    assert run_cli(run, cli_env).returncode == 0
    assert run_cli(["export", str(pretrained), "--out", str(base)], cli_env).returncode == 0
    data = {}
    for name, rows in (("both", conversations(trained)), ("repeat", conversations(trained, ["Repeat the words."]))):
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
        data[name] = tmp_path / f"{name}-data"
        prep = ["data", "prepare", "--format", "chat", "--input", str(tmp_path / f"{name}.jsonl")]
        prep += ["--out", str(data[name]), "--tokenizer", str(base / "tokenizer.json"), "--val-fraction", "0.02"]
        result = run_cli(prep, cli_env)
        assert result.returncode == 0, result.stderr[-2000:]
    return base, data


def fine_tune(base, data, run_dir, cli_env, steps: int, *extra: str) -> None:
    run = ["train", "--data.path", str(data), "--run.dir", str(run_dir), *E2E_MODEL, "--training.steps", str(steps)]
    run += ["--model.init_from", f"hf:{base}", "--training.warmup_steps", "20", "--run.log_every", "100", *extra]
    result = run_cli(run, cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"initialised from hf:{base}" in result.stderr + result.stdout


@pytest.mark.multiproc
def test_fine_tune_a_pretrained_model_into_a_chat_assistant(pretrained, cli_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    held, _ = split()
    base, data = pretrained
    tuned, out = tmp_path / "tuned", tmp_path / "tuned-hf"
    fine_tune(base, data["both"], tuned, cli_env, 400, "--training.lr", "3e-3")
    assert run_cli(["export", str(tuned), "--out", str(out)], cli_env).returncode == 0

    scores = {"before": scores_of(base, cli_env, held), "after": scores_of(out, cli_env, held)}
    accuracy = {name: exact(rows) for name, rows in scores.items()}
    stopped = sum(reason == "stop" for _, reason, _ in scores["after"]) / len(scores["after"])
    assert accuracy["after"] >= 0.8 and accuracy["after"] >= accuracy["before"] + 0.7, accuracy
    assert stopped >= 0.95, stopped

    # transformers renders the same prompt from the exported template and generates the same text
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out).eval()
    assert (out / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (out / "tokenizer_config.json").read_text()
    )
    for (got, _, _), (words, task) in zip(scores["after"][:10], [(w, t) for w in held for t in TASKS][:10]):
        ids = tok.apply_chat_template(ask(task, words), add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
        assert tok.decode(new[0, ids.shape[1] :], skip_special_tokens=True) == got


@pytest.mark.multiproc
def test_lora_teaches_a_chat_model_a_new_task(pretrained, cli_env, tmp_path):
    """A chat model that only repeats (fully fine-tuned on "Repeat the words.") learns to reverse
    through LoRA adapters on its frozen weights; the LoRA run's own directory is served (its
    adapters merged into the base)."""
    held, _ = split()
    base, data = pretrained
    repeats, repeats_hf, lora = tmp_path / "repeats", tmp_path / "repeats-hf", tmp_path / "lora"
    fine_tune(base, data["repeat"], repeats, cli_env, 150, "--training.lr", "3e-3")
    assert run_cli(["export", str(repeats), "--out", str(repeats_hf)], cli_env).returncode == 0
    adapters = ("--peft.method", "lora", "--peft.rank", "16", "--training.lr", "5e-3")
    fine_tune(repeats_hf, data["both"], lora, cli_env, 400, *adapters)
    before, after = scores_of(repeats_hf, cli_env, held), scores_of(lora, cli_env, held)
    reverse = [i for i, (words, task) in enumerate((w, t) for w in held for t in TASKS) if task.startswith("Reverse")]
    before_reverse, after_reverse = ([rows[i] for i in reverse] for rows in (before, after))
    # when written: reversed 0.025 -> 0.925 of the held-out requests, all 0.29 -> 0.96
    assert exact(before_reverse) <= 0.2 and exact(after_reverse) >= 0.8, (exact(before_reverse), exact(after_reverse))
    assert exact(after) >= 0.85, exact(after)


def test_rows_of_the_common_chat_datasets_are_read_and_dropped_text_is_refused():
    """ultrachat_200k and no_robots repeat the first user turn as "prompt", UltraFeedback's SFT split
    carries its pair beside the messages, parquet exports write null columns: all read as the
    messages; a system prompt or another prompt beside them would be dropped, so it is refused."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for extra in ({"prompt": "q", "prompt_id": "7"}, {"system": None, "completion": ""}, {"chosen": turns}):
        assert conversation({"messages": turns, **extra}, "rows.jsonl:1") == turns
    for extra, key in (({"prompt": "another question"}, "prompt"), ({"system": "be brief"}, "system")):
        with pytest.raises(DataError, match=f"rows.jsonl:1 has '{key}', which meshtrain cannot use beside"):
            conversation({"messages": turns, **extra}, "rows.jsonl:1")


def test_trl_conversational_prompt_completion_rows_learn_the_completion_only(tokenizer):
    """TRL's {"prompt": [messages], "completion": [assistant messages]}: the conversation is prompt +
    completion, and as in TRL only the completion is learned (an assistant turn inside the prompt is
    not); a completion that is not the assistant's is refused."""
    prompt = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "a2"}]}
    messages = conversation(row, "rows.jsonl:1")
    assert [m["content"] for m in messages] == ["q1", "a1", "q2", "a2"]
    template = ChatTemplate(DEFAULT_CHAT_TEMPLATE, end_of_text(tokenizer)[0])
    [(ids, mask)] = tokenize_conversations(tokenizer, template, [(messages, "rows.jsonl:1")], "assistant")
    learned = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert "a2" in learned and "a1" not in learned and "q2" not in learned
    with pytest.raises(DataError, match='rows.jsonl:1: the "completion" holds a user message'):
        conversation({**row, "completion": [{"role": "user", "content": "a2"}]}, "rows.jsonl:1")
    with pytest.raises(DataError, match="rows.jsonl:1: prompt message 2 has 'weight'"):
        conversation({**row, "prompt": [prompt[0], {**prompt[1], "weight": 1}, prompt[2]]}, "rows.jsonl:1")


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}<turn>{% endfor %}{{ eos_token }}",  # renders no message at all
        "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
    ],
    ids=["constant", "drops-system"],
)
def test_a_template_that_leaves_out_a_message_is_refused(source, tokenizer):
    """Its shards would hold the template's own text instead of the conversations, silently."""
    messages = [
        {"role": "system", "content": "Reverse the words."},
        {"role": "user", "content": "red cat"},
        {"role": "assistant", "content": "cat red"},
    ]
    template = ChatTemplate(source, end_of_text(tokenizer)[0])
    with pytest.raises(DataError, match=r"rows.jsonl:3: the chat template leaves out the text of a (system|user)"):
        tokenize_conversations(tokenizer, template, [(messages, "rows.jsonl:3")], "assistant")


def test_blended_sources_with_other_end_tokens_are_refused(corpus, tmp_path):
    """One tokenizer.json prepared with two tokenizer_config.json (a base's end of text, an instruct
    model's end of turn): the run would keep the first's, and serve would stop on a token the other's
    answers do not end with."""
    base = llama3_like_tokenizer(corpus, tmp_path / "base")
    instruct = tmp_path / "instruct"
    instruct.mkdir()
    (instruct / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    (instruct / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|start|>"}))
    (tmp_path / "a.txt").write_text("some text for the blend " * 20)
    for name, directory in (("web", base), ("code", base), ("chat", instruct)):
        prepare([tmp_path / "a.txt"], tmp_path / name, tokenizer=directory / "tokenizer.json", progress=False)
    Blend(f"{tmp_path / 'web'}:0.5,{tmp_path / 'code'}:0.5", 64)
    with pytest.raises(DataError, match=r"data.path: .*chat was prepared with end/begin tokens \('<\|start\|>'"):
        Blend(f"{tmp_path / 'web'}:0.8,{tmp_path / 'chat'}:0.2", 64)


def test_a_resume_on_the_same_conversations_with_other_targets_is_refused(chat_rows, corpus, tmp_path):
    """--chat-targets all gives the same tokens with other loss masks: other data to resume on."""
    write_jsonl(tmp_path / "chat.jsonl", chat_rows[:40])
    for name, targets in (("assistant", "assistant"), ("all", "all")):
        prepare(
            [tmp_path / "chat.jsonl"],
            tmp_path / name,
            tokenizer=corpus / "tokenizer.json",
            val_fraction=0,
            progress=False,
            chat=ChatOptions(DEFAULT_CHAT_TEMPLATE, targets=targets),
        )
    trained, other = (Blend(str(tmp_path / name), 64) for name in ("assistant", "all"))
    loader = trained.loader(4, 0, 1, seed=1)
    loader.next_batch()
    state = loader.state_dict()
    trained.loader(4, 0, 1, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="trained on other data: .*loss masks"):
        other.loader(4, 0, 1, seed=1).load_state_dict(state)
    # plain text has no masks: its id is what earlier checkpoints recorded, so they still resume
    text = Dataset(corpus, 64).manifest
    sums = [text["tokenizer_sha256"], *(shard["sha256"] for shard in text["shards"])]
    assert Dataset(corpus, 64).content_id == hashlib.sha256(" ".join(sums).encode()).hexdigest()[:16]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
@pytest.mark.parametrize("data_format", ["chat", "preference"])
def test_table_rows_keep_or_refuse_their_columns_as_json_lines_do(data_format, kind, corpus, tmp_path):
    """A Parquet or datasets column of conversation text meshtrain would drop (a system prompt) is
    refused as the same JSON key is, not left unread; a metadata column (an id) is left alone."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    one = {"messages": turns} if data_format == "chat" else {"prompt": "q", "chosen": "a", "rejected": "b"}

    def prepare_rows(rows, name):
        source = tmp_path / {"jsonl": f"{name}.jsonl", "parquet": f"{name}.parquet", "datasets": name}[kind]
        if kind == "jsonl":
            write_jsonl(source, rows)
        elif kind == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), source)
        else:
            datasets.Dataset.from_list(rows).save_to_disk(str(source))
        options = ChatOptions(DEFAULT_CHAT_TEMPLATE, format=data_format)
        prepare(
            [source], tmp_path / f"{name}-out", corpus / "tokenizer.json", val_fraction=0, progress=False, chat=options
        )
        return prepared_tokens(tmp_path / f"{name}-out")

    with pytest.raises(DataError, match=r"(:| row )1 has 'system', which meshtrain cannot use beside"):
        prepare_rows([{**one, "system": "be brief", "id": i} for i in range(8)], "system")
    # a null system cell is no system prompt; an id is metadata
    kept = prepare_rows([{**one, "system": None, "id": i} for i in range(8)], "kept")
    assert kept == prepare_rows([one] * 8, "plain")
    if data_format == "chat":  # one row's weight: a table gives every other message a null one, which is none
        weighted = [{"messages": [turns[0], {**turns[1], "weight": 1}]}] + [one] * 7
        assert prepare_rows(weighted, "weighted") == kept
