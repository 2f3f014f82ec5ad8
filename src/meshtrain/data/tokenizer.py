"""Tokenizer helpers shared by `data prepare`, the loader's checks, training, `serve` and export: which
token ends a text, loading and training a Hugging Face tokenizer, its canonical fingerprint, and
tokenizing a document of any length in bounded memory."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from meshtrain.data.chat import TEMPLATE_FILE
from meshtrain.errors import DataError
from meshtrain.files import copy_file
from meshtrain.logs import log

TOKENIZER_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json: its special tokens (kept with it)
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # older transformers' file of them, read where the config lacks one
EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")

WINDOW_CHARS = 1 << 18  # a long document is tokenized a window of this many characters at a time
TAIL_CHARS = 1 << 12  # the end of a window, whose tokens may change once the text goes on
CHECK_CHARS = 1 << 14  # how far a cut's tokens are compared with the window's own


def end_of_text(tokenizer, directory: Path | None = None) -> tuple[str | None, int | None]:
    """The tokenizer's end-of-text token and id, or (None, None): the `eos_token` configured beside it
    where there is one (a Hugging Face model's: Qwen2.5-Instruct's <|im_end|>, Llama 3 instruct's
    <|eot_id|>), else meshtrain's, Llama 3's, SentencePiece's or Gemma's. The one place that decides
    it: data prepare separates documents with it and ends chat turns at it, training's sample,
    `generate` and `serve` stop on it, export names it."""
    token = _configured_token(tokenizer, directory, "eos_token")
    if token is None:
        token = next((t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
    return token, tokenizer.token_to_id(token) if token else None


def begin_of_text(tokenizer, directory: Path | None = None) -> str | None:
    """The `bos_token` configured beside the tokenizer (Llama 3's <|begin_of_text|>, Mistral's <s>),
    or None: what a chat template's `bos_token` renders, in `data prepare` as in `serve`, so that a
    fine-tuned conversation and a served one begin alike (as transformers' apply_chat_template
    renders them)."""
    return _configured_token(tokenizer, directory, "bos_token")


def _configured_token(tokenizer, directory: Path | None, key: str) -> str | None:
    """`key` ("bos_token" or "eos_token") as transformers reads it beside a tokenizer.json:
    tokenizer_config.json's, else special_tokens_map.json's (older models keep their special tokens
    only there). Both files are checked whichever key is asked for, so that every command that reads
    them refuses the same inconsistencies."""
    if directory is None:
        return None
    config = _json_object(Path(directory, TOKENIZER_CONFIG))
    tokens = {name: _agreed_token(tokenizer, Path(directory), config, name) for name in ("bos_token", "eos_token")}
    _check_added_tokens(tokenizer, Path(directory, TOKENIZER_CONFIG), config, tokens)
    _check_added_vocabulary(tokenizer, Path(directory), config)
    _check_encoding_settings(tokenizer, Path(directory, TOKENIZER_CONFIG), config)
    return tokens[key]


def _json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError:
        content = None
    if not isinstance(content, dict):
        raise DataError(f"{path} is not a JSON object: fix or remove it")
    return content


def _agreed_token(tokenizer, directory: Path, config: dict, key: str) -> str | None:
    """`key`'s token where tokenizer_config.json and special_tokens_map.json name it: transformers'
    versions give either file precedence, so two different tokens are refused."""
    named = {}
    for name, content in (
        (TOKENIZER_CONFIG, config),
        (SPECIAL_TOKENS_MAP, _json_object(directory / SPECIAL_TOKENS_MAP)),
    ):
        if (token := _token_of(content.get(key), directory / name, key)) is not None:
            named[name] = token
    if len(set(named.values())) > 1:
        raise DataError(
            f"{directory}: {key} is {named[TOKENIZER_CONFIG]!r} in {TOKENIZER_CONFIG} but "
            f"{named[SPECIAL_TOKENS_MAP]!r} in {SPECIAL_TOKENS_MAP}: make both name the same token"
        )
    for name, token in named.items():
        if tokenizer.token_to_id(token) is None:
            raise DataError(
                f"{directory / name}: {key} {token!r} is not a token of the tokenizer beside it: correct {key} "
                "(or the tokenizer)"
            )
    return next(iter(named.values()), None)


def _token_of(value, path: Path, key: str) -> str | None:
    """A special token as the files write it: a string or an AddedToken's {"content": ...}; null or ""
    for none."""
    token = value.get("content") if isinstance(value, dict) else value
    if (token is not None or isinstance(value, dict)) and not isinstance(token, str):
        raise DataError(
            f'{path}: {key} is {value!r}: it should be a token (a string or {{"content": ...}}); correct it'
        )
    return token or None


def _check_added_vocabulary(tokenizer, directory: Path, config: dict) -> None:
    """Tokens that tokenizer_config.json's added_tokens_decoder, or its or special_tokens_map.json's
    additional_special_tokens, add: transformers adds one that tokenizer.json lacks, and would encode
    it as one token where meshtrain (reading tokenizer.json) encodes its characters. Refused unless
    tokenizer.json holds each one (at the same id)."""
    added = config.get("added_tokens_decoder") or {}
    wanted = [(str(entry.get("content")), key) for key, entry in added.items() if isinstance(entry, dict)]
    for name, content in (
        (TOKENIZER_CONFIG, config),
        (SPECIAL_TOKENS_MAP, _json_object(directory / SPECIAL_TOKENS_MAP)),
    ):
        extra = content.get("additional_special_tokens") or []
        wanted += [(_token_of(t, directory / name, "additional_special_tokens"), None) for t in extra]
    for token, at in wanted:
        have = tokenizer.token_to_id(token) if token else None
        if token and (have is None or (at is not None and str(have) != str(at))):
            where = "is not in tokenizer.json" if have is None else f"is id {have} in tokenizer.json, not {at}"
            raise DataError(
                f"{directory}: the tokenizer files add the token {token!r}, which {where}: transformers would "
                "encode it as one token and meshtrain as text; save the tokenizer again with transformers "
                "(save_pretrained) so that tokenizer.json holds it"
            )


def _check_added_tokens(tokenizer, path: Path, config: dict, tokens: dict[str, str | None]) -> None:
    """tokenizer_config.json's add_bos_token and add_eos_token against what tokenizer.json's
    post-processor adds to a text, which meshtrain follows (`document_prefix`): transformers 4's Llama
    and Gemma tokenizers rebuild the post-processor from the flags, so where the two disagree the
    model would be trained and served with other special tokens than transformers gives it."""
    if config.get("add_bos_token") is None and config.get("add_eos_token") is None:
        return
    prefix, suffix = _affixes(tokenizer)
    for flag, key, added, where in (
        ("add_bos_token", "bos_token", prefix, "before"),
        ("add_eos_token", "eos_token", suffix, "after"),
    ):
        value = config.get(flag)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise DataError(f"{path}: {flag} is {value!r}: it must be true or false")
        token_id = tokenizer.token_to_id(tokens[key]) if tokens[key] else None
        puts = " ".join(tokenizer.id_to_token(i) for i in added) or "nothing"
        if value != bool(added):
            problem, fix = "", f"set {flag} to {json.dumps(bool(added))} to match tokenizer.json"
        elif value and token_id is not None and added != [token_id]:
            problem, fix = f", not {key} {tokens[key]}", f"make {key} the token tokenizer.json puts there"
        else:
            continue
        raise DataError(
            f"{path}: {flag} is {json.dumps(value)} but tokenizer.json's post-processor puts {puts} {where} a "
            f"text{problem}: {fix}"
        )


def _steps(part: dict | None) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer as its steps, Sequences flattened."""
    if not part:
        return []
    if part.get("type") == "Sequence":
        return [step for sub in part.get("normalizers") or part.get("pretokenizers") or [] for step in _steps(sub)]
    return [part]


def _encoding_settings(tokenizer) -> dict[str, bool]:
    """How tokenizer.json's normalizer and pre-tokenizer encode text, as the tokenizer_config.json
    flags that transformers rebuilds them from: add_prefix_space (a space, or Metaspace's "▁", put
    before a text), legacy (Metaspace's put before every segment, after special tokens too, not only
    the first) and do_lower_case (BERT's normalizer lowercasing)."""
    spec = json.loads(tokenizer.to_str())
    steps = {step.get("type"): step for step in _steps(spec.get("normalizer")) + _steps(spec.get("pre_tokenizer"))}
    settings = {}
    if "ByteLevel" in steps:
        settings["add_prefix_space"] = bool(steps["ByteLevel"].get("add_prefix_space"))
    elif "Metaspace" in steps:  # its prepend_scheme, or an older tokenizers' add_prefix_space
        metaspace = steps["Metaspace"]
        scheme = metaspace.get("prepend_scheme") or ("always" if metaspace.get("add_prefix_space", True) else "never")
        settings["add_prefix_space"] = scheme != "never"
        if scheme != "never":
            settings["legacy"] = scheme == "always"
    elif "Prepend" in steps:  # Llama 2's normalizer
        settings["add_prefix_space"] = True
    if "BertNormalizer" in steps:
        settings["do_lower_case"] = bool(steps["BertNormalizer"].get("lowercase"))
    return settings


def _check_encoding_settings(tokenizer, path: Path, config: dict) -> None:
    """tokenizer_config.json's flags that make transformers rebuild the normalizer or pre-tokenizer
    (`_encoding_settings`) against what tokenizer.json does, which meshtrain encodes with: where the
    two disagree (GPT-2's add_prefix_space true beside a tokenizer.json without it), transformers
    gives other ids than those the model was trained on. split_special_tokens true is refused too:
    transformers then encodes a special token written in a text (`<|endoftext|>`) as plain
    characters, where meshtrain, as tokenizer.json does, reads it as the special token."""
    split = config.get("split_special_tokens")
    if split is not None and not isinstance(split, bool):
        raise DataError(f"{path}: split_special_tokens is {split!r}: it must be true or false")
    if split:
        raise DataError(
            f"{path}: split_special_tokens is true but tokenizer.json reads special tokens in a text as special "
            "tokens, as meshtrain does (transformers would split them into plain characters and give other ids): "
            "set split_special_tokens to false or remove it"
        )
    for flag, own in _encoding_settings(tokenizer).items():
        value = config.get(flag)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise DataError(f"{path}: {flag} is {value!r}: it must be true or false")
        if value != own:
            raise DataError(
                f"{path}: {flag} is {json.dumps(value)} but tokenizer.json encodes with {flag} {json.dumps(own)} "
                f"(transformers would rebuild it and give other ids than meshtrain, which follows tokenizer.json): "
                f"set {flag} to {json.dumps(own)} or remove it"
            )


def _affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer's post-processor puts before a text and after it."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    return (full[: starts[0]], full[starts[0] + len(plain) :]) if starts else ([], [])


def document_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer's post-processor puts before a text (Llama 3's
    <|begin_of_text|>; none for meshtrain's own BPE or Qwen's): `data prepare` begins each document
    with them, as `serve` and `generate` begin a prompt, so the model meets the start it was trained on."""
    return _affixes(tokenizer)[0]


def encode_prompt(tokenizer, text: str, prefix: list[int] | None = None) -> list[int]:
    """A text to continue, as a prepared document begins: `document_prefix` (or `prefix`, that
    computed once), then the text's ids (no suffix a post-processor would add)."""
    prefix = document_prefix(tokenizer) if prefix is None else prefix
    return prefix + tokenizer.encode(text, add_special_tokens=False).ids


def copy_tokenizer(source: str | Path, directory: Path, template: Path | None = None) -> Path:
    """A tokenizer.json into `directory` with the tokenizer_config.json and special_tokens_map.json
    beside it (its eos and bos tokens), and `template`, the chat template chat data was rendered with:
    data prepare keeps them with the data, training with the run, so serve and export render and stop
    as the model learned."""
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if (config := Path(source).parent / name).is_file():
            copy_file(config, directory / name)
    if template is not None:
        copy_file(template, directory / TEMPLATE_FILE)
    return copy_file(source, directory / "tokenizer.json")


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({e})") from None
    # saved after a call that truncated or padded: every document (prompt) would be cut or padded
    for setting, value in (("truncation", tokenizer.truncation), ("padding", tokenizer.padding)):
        if value is not None:
            raise DataError(
                f"{path} sets {setting} ({value}), which would cut or pad every text meshtrain encodes:"
                f' set "{setting}": null in it (transformers turns it off on each call)'
            )
    return tokenizer


def train_bpe(texts: Iterator[str] | list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained on the input with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least 257")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_fingerprint(path: str | Path) -> str:
    """What decides which id a text becomes: the model (vocabulary, merges), the added tokens, the
    normalizer and pre-tokenizer of a tokenizer.json, hashed in a canonical form (the same tokenizer
    saved by `tokenizers` or by transformers' save_pretrained has the same fingerprint)."""
    spec = json.loads(Path(path).read_text())
    canonical = {
        "model": spec.get("model"),
        "added_tokens": sorted((t["id"], t["content"]) for t in spec.get("added_tokens") or []),
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
    }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def encode_long(tokenizer, chunks: Iterable[str], window: int = WINDOW_CHARS) -> Iterator[list[int]]:
    """The token ids of one document given as text chunks, in pieces, holding about `window`
    characters and their encoding at a time: a tokenizer's memory grows with the text it encodes
    (about 130 bytes per character), so one 80 MB document would need 10 GB whole.

    Each window is encoded and cut at a token boundary near its end that the encoding of the text
    from there on agrees with (the same ids at the same places for CHECK_CHARS): the tokens before
    the cut do not depend on what follows, and the text after it tokenizes as if it started there.
    That is what a tokenizer splitting on pre-token boundaries (BPE, WordPiece, Unigram) gives, so
    the ids equal the whole document's encoding. A window without such a boundary (one word of a
    million characters) is cut at its last candidate and logged."""
    pending = ""
    for chunk in chunks:
        pending += chunk
        while len(pending) > window + TAIL_CHARS + CHECK_CHARS:
            ids, cut = _encode_to_a_cut(tokenizer, pending[:window])
            yield ids
            pending = pending[cut:]
    if pending:
        yield tokenizer.encode(pending, add_special_tokens=False).ids


def _encode_to_a_cut(tokenizer, text: str) -> tuple[list[int], int]:
    """The ids of `text` up to a cut that re-encoding from it confirms, and the cut (a character
    offset). Candidates step back from the end a CHECK_CHARS at a time."""
    whole = tokenizer.encode(text, add_special_tokens=False)
    ids, offsets = whole.ids, whole.offsets
    trusted = len(text) - TAIL_CHARS  # tokens ending before this are the text's own
    first = None
    for back in range(1, 9):
        target = trusted - back * CHECK_CHARS
        k = next((i for i, (start, _) in enumerate(offsets) if start >= target), None)
        if k is None or k == 0 or offsets[k][0] <= offsets[k - 1][0]:
            continue
        cut = offsets[k][0]
        first = first or (k, cut)
        again = tokenizer.encode(text[cut:trusted], add_special_tokens=False)
        n = sum(1 for _, end in offsets[k:] if end <= trusted - TAIL_CHARS)
        if again.ids[:n] == ids[k : k + n] and [s + cut for s, _ in again.offsets[:n]] == [
            s for s, _ in offsets[k : k + n]
        ]:
            return ids[:k], cut
    if first is None:  # a single token spans the window: cut at the window's end
        return ids, len(text)
    log.warning(f"a document has no stable token boundary in {len(text):,} characters; cut there")
    return ids[: first[0]], first[1]


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token stands for (OpenAI's logprobs `bytes`, from which a client rebuilds a
    character split over tokens): decoding a token alone turns its piece of a UTF-8 character into
    U+FFFD. A byte-level BPE's (GPT-2, Llama 3, Qwen) characters map back to bytes; SentencePiece's
    byte fallback piece <0xNN> is that byte; an added token, or any other, is its decoded text."""
    from tokenizers import decoders

    piece = tokenizer.id_to_token(token)
    if piece is None or token in tokenizer.get_added_tokens_decoder():
        return (piece or "").encode("utf-8")
    if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_CHAR for c in piece):
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return tokenizer.decode([token]).encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable Latin-1 bytes stand for themselves, the
    other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()
