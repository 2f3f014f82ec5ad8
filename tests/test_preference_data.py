"""Preference data for DPO: TRL's three spellings of a pair prepared alike through the chat template,
each pair stored as two adjacent masked conversations in one split, and loaded as one window of two
rows (chosen, rejected) that a batch interleaves."""

import json
import random
import re

import numpy as np
import pytest

from conftest import assert_user_error, run_cli
from examples.word_task import TASKS, WORDS, answer, ask
from meshtrain.data import prepare
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from meshtrain.data.loader import Blend, Dataset, DistributedLoader
from meshtrain.data.prepare import ChatOptions
from meshtrain.data.tokenizer import end_of_text, load_tokenizer
from meshtrain.data.windows import IGNORE_INDEX, TokenWindows, to_batch
from meshtrain.errors import DataError

PREFERENCE = ChatOptions(DEFAULT_CHAT_TEMPLATE, format="preference")


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return load_tokenizer(corpus / "tokenizer.json")


@pytest.fixture(scope="module")
def eos(tokenizer) -> str:
    return end_of_text(tokenizer)[0]


def prepare_rows(corpus, rows, out, val_fraction=0.0, chat=PREFERENCE) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out.parent / f"{out.name}.jsonl", rows)
    return prepare(
        [out.parent / f"{out.name}.jsonl"],
        out,
        tokenizer=corpus / "tokenizer.json",
        val_fraction=val_fraction,
        progress=False,
        workers=1,
        chat=chat,
    )


def decoded_targets(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> str:
    return tokenizer.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)


def test_the_three_spellings_of_a_pair_give_the_same_tokens_and_masks(corpus, tokenizer, eos, tmp_path):
    history = [{"role": "system", "content": "Reverse the words."}, user("red cat"), assistant("cat red")]
    prompt = [*history, user("sun moon star")]
    rows = [
        {"prompt": "sun moon star", "chosen": "star moon sun", "rejected": "no", "id": 7},  # standard
        {"prompt": [user("sun moon star")], "chosen": [assistant("star moon sun")], "rejected": [assistant("no")]},
        {
            "chosen": [user("sun moon star"), assistant("star moon sun")],
            "rejected": [user("sun moon star"), assistant("no")],
        },
        # a prompt with an earlier answer in it: only the answers after the prompt are targets
        {"prompt": prompt, "chosen": [assistant("star moon sun")], "rejected": [assistant("no")]},
        {"chosen": [*prompt, assistant("star moon sun")], "rejected": [*prompt, assistant("no")]},
        # UltraFeedback's: the prompt's text beside whole conversations, and a copy of the chosen one
        {
            "prompt": "sun moon star",
            "chosen": [user("sun moon star"), assistant("star moon sun")],
            "rejected": [user("sun moon star"), assistant("no")],
            "messages": [user("sun moon star"), assistant("star moon sun")],
            "score_chosen": 9.0,
        },
    ]
    rows[0]["rejected"] = "no"
    manifest = prepare_rows(corpus, rows, tmp_path / "data")
    assert manifest["format"] == "preference" and manifest["pairs"] == {"train": 6, "val": 0}
    assert manifest["documents"] == {"train": 12, "val": 0} and manifest["chat_template"] == "chat_template.jinja"
    train = Dataset(tmp_path / "data", 128).train
    assert len(train) == 6 and train.too_long == 0 and train.conversations == train.pairs == 6
    windows = [train.window(w) for w in range(6)]
    for tokens, mask in [*windows[1:3], windows[5]]:
        np.testing.assert_array_equal(tokens, windows[0][0])
        np.testing.assert_array_equal(mask, windows[0][1])
    np.testing.assert_array_equal(windows[4][0], windows[3][0])
    np.testing.assert_array_equal(windows[4][1], windows[3][1])
    for (tokens, mask), rendered in ((windows[0], [user("sun moon star")]), (windows[3], prompt)):
        assert decoded_targets(tokenizer, tokens[0], mask[0]) == f"star moon sun{eos}"
        assert decoded_targets(tokenizer, tokens[1], mask[1]) == f"no{eos}"
        # each row is the prompt + answer, exactly as the template renders it, then padding
        for row, answer_text in ((0, "star moon sun"), (1, "no")):
            text = ChatTemplate(DEFAULT_CHAT_TEMPLATE, eos).render([*rendered, assistant(answer_text)])
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            assert tokens[row, : len(ids)].tolist() == ids
            assert (tokens[row, len(ids) :] == tokenizer.token_to_id(eos)).all() and not mask[row, len(ids) :].any()


def word_pairs(n: int) -> list[dict]:
    """n distinct pairs: the right answer of a word task chosen, the words rotated rejected; every
    third row in each of TRL's spellings (standard, conversational, implicit prompt)."""
    rng, rows, seen = random.Random(0), [], set()
    while len(rows) < n:
        task = rng.choice(list(TASKS))
        words = tuple(rng.choice(WORDS) for _ in range(3))
        good, bad = answer(task, words), " ".join(words[1:] + words[:1])
        if (task, words) in seen or good == bad:
            continue
        seen.add((task, words))
        prompt = ask(task, words, system=len(rows) % 2 == 0)
        if len(rows) % 3 == 0:
            rows.append({"prompt": " ".join(words), "chosen": good, "rejected": bad, "task": task})
        elif len(rows) % 3 == 1:
            rows.append({"prompt": prompt, "chosen": [assistant(good)], "rejected": [assistant(bad)]})
        else:
            rows.append({"chosen": [*prompt, assistant(good)], "rejected": [*prompt, assistant(bad)]})
    return rows


@pytest.fixture(scope="module")
def pairs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    rows = word_pairs(300)
    manifest = prepare_rows(corpus, rows, root / "data", val_fraction=0.2)
    return root / "data", rows, manifest


def test_each_pair_is_two_adjacent_conversations_in_one_split(pairs, tokenizer, eos):
    path, rows, manifest = pairs
    dataset = Dataset(path, 64)
    assert dataset.preference and dataset.chat and dataset.template_path.read_text() == DEFAULT_CHAT_TEMPLATE
    assert manifest["pairs"]["val"] > 20 and manifest["pairs"]["train"] > 200
    assert manifest["pairs"]["train"] + manifest["pairs"]["val"] == len(rows)
    expected = {}
    for row in rows:  # what each pair's rows decode to: (prompt text, chosen answer, rejected answer)
        chosen = row["chosen"] if isinstance(row["chosen"], str) else row["chosen"][-1]["content"]
        rejected = row["rejected"] if isinstance(row["rejected"], str) else row["rejected"][-1]["content"]
        expected[(chosen, rejected)] = expected.get((chosen, rejected), 0) + 1
    found = {}
    for split in (dataset.train, dataset.val):
        assert split.too_long == 0
        for w in range(len(split)):
            tokens, mask = split.window(w)
            first = [int(np.argmax(m)) for m in mask]
            assert first[0] == first[1]  # one prompt...
            assert tokens[0, : first[0]].tolist() == tokens[1, : first[1]].tolist()  # ...the same
            key = tuple(decoded_targets(tokenizer, t, m).removesuffix(eos) for t, m in zip(tokens, mask))
            found[key] = found.get(key, 0) + 1
    assert found == expected  # every pair once, whole, its chosen before its rejected


def test_a_tiny_corpus_holds_out_a_whole_pair(corpus, tmp_path):
    rows = word_pairs(3)
    manifest = prepare_rows(corpus, rows, tmp_path / "data", val_fraction=0.01)
    assert manifest["pairs"] == {"train": 2, "val": 1} and manifest["documents"] == {"train": 4, "val": 2}
    dataset = Dataset(tmp_path / "data", 64)
    assert len(dataset.train) == 2 and len(dataset.val) == 1
    tokens, mask = dataset.val.window(0)
    assert mask[0].any() and mask[1].any() and tokens[0, 0] == tokens[1, 0]


def test_a_batch_interleaves_chosen_and_rejected_rows(pairs, corpus):
    path, _, _ = pairs
    train = Dataset(path, 64).train
    inputs, targets, positions = train.gather([3, 0, 5])
    assert positions is None  # one conversation a row: nothing to mask
    assert inputs.shape == targets.shape == (6, 64)
    for i, w in enumerate([3, 0, 5]):
        tokens, mask = train.window(w)
        for row in (0, 1):
            assert inputs[2 * i + row].tolist() == tokens[row, :-1].tolist()
            want = np.where(mask[row, 1:] == 1, tokens[row, 1:], IGNORE_INDEX)
            assert targets[2 * i + row].tolist() == want.tolist()
    assert (targets == IGNORE_INDEX).sum() > targets.numel() // 2  # prompts and padding
    assert (targets[:, -1] == IGNORE_INDEX).all()  # padded to the end
    # the loader: global batches count pairs, each rank gets 2 rows per pair, the count is the pairs
    loader = DistributedLoader(train, global_batch=4, dp_rank=1, dp_size=2, seed=0)
    x, y, _, n = loader.next_batch()
    assert x.shape == y.shape == (4, 64) and n == 4
    picks = [loader._window(0, k) for k in (2, 3)]
    expected_x, _, _ = train.gather(picks)
    assert x.tolist() == expected_x.tolist()
    # plain text batches are as they were: two views of one buffer, every token a target
    text = TokenWindows.from_file(next(corpus.glob("train-*.bin")), "uint16", 16)
    tx, ty, _ = text.gather([0, 1])
    assert tx.shape == ty.shape == (2, 16) and ty.data_ptr() == tx.data_ptr() + 8
    assert tx[0, 1:].tolist() == ty[0, :-1].tolist()
    # a mask row beside a maskless row: only the masked row loses targets
    row = np.arange(17)
    mixed_x, mixed_y, _ = to_batch([(row, None), (row, (row % 2).astype(np.uint8))])
    assert mixed_y[0].tolist() == list(range(1, 17))
    assert mixed_y[1].tolist() == [t if t % 2 else IGNORE_INDEX for t in range(1, 17)]


def test_pairs_too_long_are_counted_and_left_out(pairs, corpus, tmp_path):
    path, rows, manifest = pairs
    lengths = Dataset(path, 64).train.pair_lengths
    cut = int(np.median(lengths.max(axis=1)))
    short = Dataset(path, cut - 1).train
    assert 0 < short.too_long < len(rows) and short.too_long + short.pairs == manifest["pairs"]["train"]
    assert short.conversations == short.pairs == len(short)
    assert (short.pair_lengths <= cut).all()
    with pytest.raises(DataError, match=r"every one of the \d+ training pairs .* raise training.seq_len"):
        Dataset(path, 8)
    # at prepare time: a pair whose longer conversation exceeds --max-tokens
    limit = ChatOptions(DEFAULT_CHAT_TEMPLATE, max_tokens=cut, format="preference")
    limited = prepare_rows(corpus, rows, tmp_path / "limited", chat=limit)
    kept = sum(limited["pairs"].values())
    assert 0 < limited["skipped_longer"] < len(rows) and kept + limited["skipped_longer"] == len(rows)
    assert (Dataset(tmp_path / "limited", 64).train.pair_lengths <= cut).all()


CHOSEN, REJECTED = [user("p"), assistant("a")], [user("p"), assistant("b")]


@pytest.mark.parametrize(
    "row, fragments",
    [
        ({"chosen": "a", "rejected": "b"}, ['no "prompt"', "add the prompt"]),
        ({"prompt": "p", "chosen": "a"}, ['no "rejected"']),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, ['no "chosen"']),
        ({"prompt": "p", "chosen": "a", "rejected": [assistant("b")]}, ["both be strings or both lists"]),
        ({"prompt": [user("p")], "chosen": "a", "rejected": "b"}, ['"prompt" must be a string']),
        ({"prompt": "p", "chosen": [assistant("a")], "rejected": [assistant("b")]}, ['"prompt" must be a non-empty']),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, ["the same answer"]),
        ({"chosen": CHOSEN, "rejected": CHOSEN}, ["the same conversation"]),
        ({"prompt": [user("p")], "chosen": [user("a")], "rejected": [assistant("b")]}, ["chosen answer holds a user"]),
        ({"chosen": [*CHOSEN, user("q")], "rejected": REJECTED}, ["chosen answer holds a user"]),
        ({"chosen": [user("p")], "rejected": REJECTED}, ["chosen answer is empty"]),
        ({"prompt": "p", "chosen": "a", "rejected": " "}, ["rejected answer is empty"]),
        ({"chosen": [user("p"), assistant("a")], "rejected": [user("q"), assistant("b")]}, ["share no first message"]),
        ({"chosen": [{"role": "tool", "content": "x"}], "rejected": REJECTED}, ["chosen message 1 has role 'tool'"]),
        ({"chosen": CHOSEN, "rejected": [user("p"), {"role": "assistant"}]}, ["rejected message 2 (assistant)"]),
        ([1, 2], ["not a JSON object"]),
        ({"prompt": "p", "chosen": "a", "rejected": "b", "system": "be kind"}, ["has 'system', which meshtrain"]),
    ],
    ids=[
        "no-prompt",
        "no-rejected",
        "chosen-type",
        "mixed",
        "prompt-type",
        "prompt-string",
        "same",
        "same-implicit",
        "user-answer",
        "user-after",
        "no-answer",
        "blank-answer",
        "no-common-prompt",
        "role",
        "content",
        "not-object",
        "unknown-key",
    ],
)
def test_a_malformed_row_is_refused_in_one_line_naming_it(row, fragments, corpus, tmp_path):
    good = {"prompt": "x", "chosen": "y", "rejected": "z"}
    with pytest.raises(DataError) as refused:
        prepare_rows(corpus, [good, row], tmp_path / "out")
    message = str(refused.value)
    assert "\n" not in message and "out.jsonl:2" in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_other_refusals(pairs, corpus, tmp_path):
    path, _, _ = pairs
    blend = Blend(str(path), 64)
    assert blend.preference and blend.template_path == path / "chat_template.jinja"
    with pytest.raises(DataError, match="holds preference pairs and .* does not"):
        Blend(f"{path}:0.5,{corpus}:0.5", 64)
    with pytest.raises(DataError, match="holds preference pairs and .* does not"):
        Blend(f"{corpus}:0.5,{path}:0.5", 64)
    with pytest.raises(DataError, match=r"all 1 pairs .* --max-tokens 3"):
        limit = ChatOptions(DEFAULT_CHAT_TEMPLATE, max_tokens=3, format="preference")
        prepare_rows(corpus, [{"prompt": "a b", "chosen": "b a", "rejected": "a"}], tmp_path / "x", chat=limit)
    (tmp_path / "notes.txt").write_text("just text")
    with pytest.raises(DataError, match="plain text; --format preference reads"):
        prepare(
            [tmp_path / "notes.txt"],
            tmp_path / "y",
            tokenizer=corpus / "tokenizer.json",
            progress=False,
            chat=PREFERENCE,
        )


def test_the_cli_prepares_preference_data_and_refuses_chat_targets(corpus, cli_env, tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", word_pairs(20))
    template = tmp_path / "chatml.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    args = ["data", "prepare", "--format", "preference", "--input", str(tmp_path / "pairs.jsonl")]
    args += ["--tokenizer", str(corpus / "tokenizer.json")]
    result = run_cli([*args, "--out", str(tmp_path / "out"), "--chat-targets", "all"], cli_env)
    assert_user_error(result, "--chat-targets", "--format preference")
    result = run_cli(
        [*args, "--out", str(tmp_path / "out"), "--chat-template", str(template), "--max-tokens", "999"], cli_env
    )
    assert result.returncode == 0, result.stderr
    counts = re.search(r"preference: (\d+) train and (\d+) validation pairs", result.stdout)
    assert counts and int(counts[1]) + int(counts[2]) == 20, result.stdout
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == template.read_text()


def test_a_messages_copy_beside_a_pair_must_be_its_chosen_conversation(corpus, tmp_path):
    """UltraFeedback's rows carry "messages", a copy of prompt + chosen, which is read past; any other
    "messages" (the rejected one, another conversation) would be dropped text, so it is refused."""
    pair = {"prompt": "p", "chosen": "a", "rejected": "b"}
    whole = {"chosen": [user("p"), assistant("a")], "rejected": [user("p"), assistant("b")]}
    copies = [{**pair, "messages": [user("p"), assistant("a")]}, {**whole, "messages": whole["chosen"]}]
    manifest = prepare_rows(corpus, [*copies, {**pair, "messages": None}], tmp_path / "kept")
    assert manifest["pairs"] == {"train": 3, "val": 0}
    for messages in ([user("p"), assistant("b")], [user("q"), assistant("a")], [user("p")], "p a"):
        with pytest.raises(DataError) as refused:
            prepare_rows(corpus, [pair, {**whole, "messages": messages}], tmp_path / "out")
        message = str(refused.value)
        assert "\n" not in message and 'out.jsonl:2 has "messages" other than its prompt + chosen' in message
