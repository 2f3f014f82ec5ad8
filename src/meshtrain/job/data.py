"""The data a job reads, and the rules that hold a job to it: each prepared directory whole and of
data.vocab_size where set, the objective's kind of data (DPO's preference pairs), model.init_from's
tokenizer and chat template, and the end-of-run sample inside the model's context. The default corpus
is prepared here on first use (`ensure_dataset`), by the launcher or rank 0, before any check needs it."""

from __future__ import annotations

from pathlib import Path

from meshtrain.config import Config, parse_data_path
from meshtrain.data import Blend, prepare, read_manifest, stdlib_sources
from meshtrain.data.format import MANIFEST
from meshtrain.errors import ConfigError, DataError
from meshtrain.logs import log
from meshtrain.model.args import ModelArgs

DEFAULT_VOCAB = 8192  # the default corpus's BPE vocabulary where data.vocab_size is unset


def ensure_dataset(cfg: Config) -> Blend:
    """Build the default corpus on first use (data.corpus = "stdlib", data.path one directory);
    otherwise the data must already be prepared. Called by the launcher before workers start, and
    by rank 0 of a run started by an external launcher."""
    paths = [Path(p) for p, _ in parse_data_path(cfg.data.path)]
    if default_corpus_pending(cfg):
        check_objective_data(cfg, None)  # not minutes of preparing before the refusal
        log.info(f"preparing the default corpus (Python standard library source) in {paths[0]} ...")
        prepare(stdlib_sources(), paths[0], vocab_size=cfg.data.vocab_size or DEFAULT_VOCAB, progress=True)
    check_prepared_vocabulary(cfg)
    return Blend(cfg.data.path, cfg.training.seq_len)


def default_corpus_pending(cfg: Config) -> bool:
    """data.path is one directory with no data yet, where training prepares the default corpus."""
    paths = parse_data_path(cfg.data.path)
    return len(paths) == 1 and not (Path(paths[0][0]) / MANIFEST).is_file() and bool(cfg.data.corpus)


def prepared_dataset(cfg: Config) -> Blend | None:
    """The data as it is here, for checks that prepare nothing (dry run, jobscript): None when it is
    not prepared yet but the default corpus would be; the trainer's error when it is missing or
    corrupt otherwise."""
    if default_corpus_pending(cfg):
        return None
    check_prepared_vocabulary(cfg)
    return Blend(cfg.data.path, cfg.training.seq_len)


def check_prepared_vocabulary(cfg: Config) -> None:
    """Each prepared directory of data.path is there and whole (the trainer's one-line error for
    missing or corrupt data), and prepared with data.vocab_size where that is set."""
    for path in (Path(p) for p, _ in parse_data_path(cfg.data.path)):
        prepared = read_manifest(path)["vocab_size"]
        if cfg.data.vocab_size is not None and prepared != cfg.data.vocab_size:
            raise DataError(
                f"data.vocab_size = {cfg.data.vocab_size} but {path} is prepared with a vocabulary of {prepared}: "
                "drop data.vocab_size to train on it, or prepare the data again into another data.path"
            )


def check_objective_data(cfg: Config, dataset: Blend | None) -> None:
    """DPO learns from preference pairs, and only DPO does. `dataset` None: not prepared yet, so the
    default corpus (plain text) would be: refused before it is prepared."""
    preference = getattr(dataset, "preference", False)
    if cfg.training.objective == "dpo" and not preference:
        what = "is not" if dataset is not None else f"holds no data yet (data.corpus {cfg.data.corpus!r} is plain text)"
        raise ConfigError(
            f"training.objective = dpo learns from preference pairs, but {cfg.data.path} {what}: prepare them "
            "with `meshtrain data prepare --format preference`"
        )
    if preference and cfg.training.objective != "dpo":
        raise ConfigError(
            f"{cfg.data.path} holds preference pairs: train on them with training.objective = dpo "
            "(plain chat data is prepared with --format chat)"
        )


def check_init_tokenizer(cfg: Config, dataset: Blend) -> None:
    """model.init_from: the data must be tokenized with the pretrained model's tokenizer, or every
    id means another token than the one the weights learned (a silent, wrong fine-tune)."""
    if not cfg.model.init_from:
        return
    from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, template_of
    from meshtrain.data.tokenizer import tokenizer_fingerprint

    model_dir = Path(cfg.model.init_from.removeprefix("hf:"))
    theirs = model_dir / "tokenizer.json"
    if not theirs.is_file():
        log.warning(f"{model_dir} has no tokenizer.json: cannot check that {cfg.data.path} was tokenized with it")
        return
    if tokenizer_fingerprint(theirs) != tokenizer_fingerprint(dataset.tokenizer_path):
        raise DataError(
            f"{cfg.data.path} was tokenized with another tokenizer than model.init_from ({theirs}): prepare the data "
            f"with it, `meshtrain data prepare --tokenizer {theirs} ...`"
        )
    if dataset.template_path and template_of(model_dir) != DEFAULT_CHAT_TEMPLATE:
        if dataset.template_path.read_text() != template_of(model_dir):
            raise DataError(
                f"{cfg.data.path} was rendered with another chat template than model.init_from's ({model_dir}): "
                f"prepare it with `--tokenizer {theirs}` (which takes the model's template along)"
            )


def check_sample_fits(cfg: Config, args: ModelArgs, dataset: Blend) -> None:
    """The end-of-run sample is the prompt's tokens and run.sample_tokens more in the model's context:
    a prompt that fills it, or a given sample_tokens beside it, would be cut silently (the default
    sample_tokens is cut to fit)."""
    from meshtrain.data.tokenizer import encode_prompt, load_tokenizer

    r = cfg.run
    if not r.sample_prompt:
        return
    prompt = len(encode_prompt(load_tokenizer(dataset.tokenizer_path), r.sample_prompt))
    given = r.sample_tokens != type(r)().sample_tokens
    if prompt >= args.max_seq_len or (given and prompt + r.sample_tokens > args.max_seq_len):
        tokens = f" and run.sample_tokens = {r.sample_tokens}" if given else ""
        raise ConfigError(
            f"run.sample_prompt ({prompt} tokens){tokens} would not fit the model's context (model.max_seq_len = "
            f"{args.max_seq_len}): shorten the prompt{' or lower sample_tokens' if given else ''}"
        )
