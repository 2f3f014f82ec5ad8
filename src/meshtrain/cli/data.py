"""`meshtrain data prepare`: inputs -> token shards + manifest, alone or as one rank of a job."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshtrain.cli.options import add_options, options_of
from meshtrain.config import option, parse_size
from meshtrain.errors import MeshtrainError


@dataclass
class PrepareOptions:
    input: list[str] = option(nargs="+")
    """Files, directories or globs (.txt, .py, .jsonl, .jsonl.gz, .jsonl.zst, .parquet; other names are refused)
    or a Hugging Face datasets save_to_disk directory."""
    out: str = option()
    """Output directory."""
    text_field: str | None = None
    """The JSON field or column holding text (default "text"; not for plain text alone, nor with --format chat or
    preference)."""
    format: Literal["text", "chat", "preference"] = "text"
    """chat: rows of "messages" (or "prompt"/"completion"), rendered with the chat template, with a loss mask;
    preference: TRL's preference rows ("prompt", "chosen", "rejected"; the prompt may be implicit in
    conversations), for training.objective dpo."""
    chat_template: str | None = None
    """chat, preference: a Jinja chat template file (default: the tokenizer's own, beside its tokenizer.json,
    else meshtrain's)."""
    chat_targets: Literal["assistant", "all"] | None = None
    """chat: the tokens the loss learns, the assistant's answers (default) or every token."""
    max_tokens: int | None = option(None, gt=0)
    """chat, preference: leave out (and count) conversations (pairs with an answer) longer than this many
    tokens."""
    workers: int | None = option(None, gt=0)
    """Tokenizing processes of this prepare, or of each rank where a job runs it on several (default:
    every core the process may run on; under srun each task's own)."""
    tokenizer_sample: int | None = option(None, parse=parse_size)
    """Text read to train the BPE, spread over the input (default 64M; not with --tokenizer)."""
    tokenizer: str | None = option(None, exclusive="tokenizer")
    """A Hugging Face tokenizer.json to use."""
    vocab_size: int | None = option(None, ge=256, exclusive="tokenizer")
    """Train a byte-level BPE of this size (default 8192)."""
    val_fraction: float = option(0.01, ge=0.0, le=0.5)
    """Share of documents held out for validation, 0 to 0.5."""
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Width of the stored token ids (auto: uint16 when the vocabulary fits)."""


def add_parser(sub) -> None:
    d = sub.add_parser("data", help="prepare training data")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    prep = dsub.add_parser(
        "prepare",
        help="tokenize text/jsonl/parquet into token shards + manifest (streamed, on every core; each rank of "
        "srun/mpirun/torchrun takes a share)",
    )
    add_options(prep, PrepareOptions)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """`data prepare`, alone or as one rank of a job (srun, mpirun, torchrun, SGE): the ranks join
    one gloo group (waiting on each other for as long as the slowest share takes) and split the work."""
    from datetime import timedelta

    from meshtrain.data import prepare
    from meshtrain.launch import detect
    from meshtrain.launch.distributed import init_distributed
    from meshtrain.logs import setup_logging

    o: PrepareOptions = options_of(args, PrepareOptions)
    if o.tokenizer and o.tokenizer_sample is not None:
        raise MeshtrainError("--tokenizer-sample sizes the text a new BPE is trained on: not with --tokenizer")
    chat = _chat_options(o)
    env = detect()
    setup_logging(env.rank)
    if env.distributed:
        init_distributed(env, "cpu", timeout=timedelta(days=7))
    manifest = prepare(
        o.input,
        o.out,
        o.tokenizer,
        o.vocab_size,
        o.val_fraction,
        o.token_dtype,
        progress=sys.stderr.isatty() and env.rank == 0,
        text_field="text" if o.text_field is None else o.text_field,  # an empty name too is taken as given
        workers=o.workers,
        sample_bytes=o.tokenizer_sample or 64 << 20,
        distributed=env.distributed,
        chat=chat,
    )
    if env.rank == 0:
        print(
            f"wrote {o.out}: {manifest['train_tokens']:,} train and {manifest['val_tokens']:,} validation tokens "
            f"in {len(manifest['shards'])} shards, vocabulary {manifest['vocab_size']} ({manifest['dtype']})"
            + (
                f"; {nulls:,} rows of null {manifest['text_field']!r} left out"
                if (nulls := manifest.get("skipped_null"))
                else ""
            )
        )
        if chat and chat.preference:
            pairs = manifest["pairs"]
            print(
                f"preference: {pairs['train']:,} train and {pairs['val']:,} validation pairs, "
                f"{manifest['target_tokens']:,} training targets"
                + (f"; {manifest['skipped_longer']:,} longer than --max-tokens left out" if chat.max_tokens else "")
            )
        elif chat:
            docs = manifest["documents"]
            print(
                f"chat: {docs['train']:,} train and {docs['val']:,} validation conversations, "
                f"{manifest['target_tokens']:,} training targets ({chat.targets})"
                + (f"; {manifest['skipped_longer']:,} longer than --max-tokens left out" if chat.max_tokens else "")
            )
    return 0


def _chat_options(o: PrepareOptions):
    """--format chat's (and preference's) options (each refused without it), with the template
    resolved: --chat-template, else the tokenizer's own (a chat_template.jinja or tokenizer_config.json
    beside it), else meshtrain's default."""
    from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, template_of
    from meshtrain.data.prepare import ChatOptions

    chat_only = {"--chat-template": o.chat_template, "--chat-targets": o.chat_targets, "--max-tokens": o.max_tokens}
    if o.format == "text":
        given = [flag for flag, value in chat_only.items() if value is not None]
        if given:
            raise MeshtrainError(f"{given[0]} is an option of chat data: add --format chat")
        return None
    if o.format == "preference" and o.chat_targets is not None:
        raise MeshtrainError(
            "--chat-targets is not an option of --format preference: the targets are the chosen and rejected answers"
        )
    if o.text_field is not None:
        rows = '"messages"' if o.format == "chat" else '"prompt", "chosen" and "rejected"'
        raise MeshtrainError(f"--text-field names the text of plain documents; {o.format} rows hold {rows}")
    if o.chat_template:
        path = Path(o.chat_template)
        if not path.is_file():
            raise MeshtrainError(f"--chat-template {path} does not exist (a Jinja chat template file)")
        template = path.read_text()
    else:
        template = template_of(Path(o.tokenizer).parent) if o.tokenizer else DEFAULT_CHAT_TEMPLATE
    ChatTemplate(template, None)  # a clear error now for one that does not parse
    return ChatOptions(template, o.chat_targets or "assistant", o.max_tokens or 0, o.format)
