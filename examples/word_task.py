"""A synthetic chat task a few-million-parameter model learns in a minute on a CPU: the system
message says whether to repeat or reverse the user's three words.

    python examples/word_task.py --out data/words.jsonl      # 3,000 conversations to fine-tune on
                                                              # + data/words.held-out.jsonl (80 unseen)
    python examples/word_task.py --out data/prefs.jsonl --preference   # the same as DPO pairs
Deterministic: the same files on every machine."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = "red blue green black white cat dog fish bird tree sun moon star rain snow wind".split()
TASKS = {"Repeat the words.": lambda words: words, "Reverse the words.": lambda words: words[::-1]}


def ask(task: str, words, system: bool = True) -> list[dict]:
    """The request: the task as the system message, the words as the user's."""
    user = {"role": "user", "content": " ".join(words)}
    return [{"role": "system", "content": task}, user] if system else [user]


def answer(task: str, words) -> str:
    return " ".join(TASKS[task](list(words)))


def split(n_train: int = 1500, n_held_out: int = 40) -> tuple[list[tuple], list[tuple]]:
    """(held-out, training) triples of words: no held-out triple is trained on."""
    combos = [(a, b, c) for a in WORDS for b in WORDS for c in WORDS]
    random.Random(0).shuffle(combos)
    return combos[:n_held_out], combos[n_held_out : n_held_out + n_train]


def conversations(triples, tasks=tuple(TASKS)) -> list[dict]:
    return [
        {"messages": [*ask(task, words), {"role": "assistant", "content": answer(task, words)}]}
        for words in triples
        for task in tasks
    ]


def preference_pairs(triples) -> list[dict]:
    """DPO rows (TRL's conversational format): the right answer chosen, the other task's rejected (a
    triple that reads the same both ways rotates instead)."""
    rows = []
    for words in triples:
        for task in TASKS:
            right = answer(task, words)
            other = next(t for t in TASKS if t != task)
            wrong = answer(other, words) if words[0] != words[-1] else " ".join([*words[1:], words[0]])
            if wrong == right:
                continue
            rows.append(
                {
                    "prompt": ask(task, words),
                    "chosen": [{"role": "assistant", "content": right}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the training JSONL; the held-out one is written beside it")
    parser.add_argument("--preference", action="store_true", help="preference pairs (prompt/chosen/rejected)")
    options = parser.parse_args()
    out, rows_of = Path(options.out), preference_pairs if options.preference else conversations
    held, train = split()
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in ((out, rows_of(train)), (out.with_suffix(".held-out.jsonl"), rows_of(held))):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {path}: {len(rows)} {'pairs' if options.preference else 'conversations'}")


if __name__ == "__main__":
    main()
