"""The generation engine: continuous batching over a KV cache, in one background thread.

Requests wait in a queue; between two decode steps the engine admits waiting requests into free
cache slots (one prefill forward each, which also samples their first token), then runs one
batched decode forward for every running request, samples each one's next token with its own
settings and generator, and streams the new text out. A finished or cancelled request (a client
that went away) frees its slot at the next step, so a new one can take it at once.

The n answers of one prompt (OpenAI's `n`, completions' `best_of`) are a group: admitted together
when n slots are free, prefilled once (the prompt's keys and values copied into the other slots),
then sampled apart, each with its own generator. A request with a grammar (response_format,
serve/grammar.py) has its logits masked to the tokens that continue it, and ends when it is whole.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshtrain.model import Llama
from meshtrain.model.kv_cache import KVCache, forward_cached
from meshtrain.serve.grammar import Constraint


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0 only with echo: score the prompt, generate nothing
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # ... times the number of times it was generated
    logprobs: int | None = None  # None: none; k: each generated token's log-probability and the k likeliest
    echo: bool = False  # also the prompt tokens' log-probabilities (what log-likelihood scoring reads)
    stop_ids: frozenset[int] = frozenset()  # special tokens given as stop strings (never in the decoded text)
    score: bool = False  # sum the generated tokens' log-probabilities (best_of ranks its answers by them)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its logits, before temperature,
    penalties or truncation: what scoring needs) and the `top` likeliest tokens at that position."""

    token: int
    logprob: float | None  # None for the first prompt token: nothing predicts it
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Request:
    """One generation. `emit` is called from the engine thread with ("text", delta) events, then one
    ("done", finish_reason) or ("error", message)."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[tuple], None]
    cancelled: bool = False
    generated: list[int] = field(default_factory=list)
    text: str = ""  # the text emitted so far
    slot: int = -1
    submitted: float = field(default_factory=time.perf_counter)
    generator: torch.Generator | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with echo and logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with logprobs, one per generated token
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times (penalties)
    score: float = 0.0  # with params.score: the sum of the generated tokens' log-probabilities
    seed_offset: int = 0  # the i-th answer of a group draws from its own generator
    constraint: Constraint | None = None  # response_format's grammar: masks every step's logits

    def cancel(self) -> None:
        self.cancelled = True


def _nth_seed(seed: int, n: int) -> int:
    """The seed of a group's n-th answer: the request's own for the first, distinct ones after it."""
    return seed if n == 0 else (seed * 1_000_003 + n) % 2**63


class Engine:
    def __init__(
        self,
        model: Llama,
        tokenizer,
        eos_ids: list[int] | int | None,
        max_batch: int,
        max_context: int,
        on_first_token: Callable[[float], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        on_prefill: Callable[[int], None] | None = None,
    ):
        self.model, self.tokenizer = model.eval(), tokenizer
        # every token that ends a generation (Llama 3 instruct: <|eot_id|> and <|end_of_text|>)
        self.eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or ())
        self.max_batch, self.max_context = max_batch, max_context
        self.device = model.tok_embeddings.weight.device
        self.cache = KVCache(model, max_batch, max_context)
        self.waiting: queue.Queue[list[Request] | None] = queue.Queue()
        self.held: list[Request] | None = None  # a group waiting for enough free slots (first in line)
        self.running: list[Request] = []
        self.free = list(range(max_batch))
        self.on_first_token = on_first_token or (lambda seconds: None)
        self.on_tokens = on_tokens or (lambda n: None)
        self.on_prefill = on_prefill or (lambda n: None)  # prompt tokens computed
        self.failure: str | None = None  # why the engine thread stopped, if it did (the server is then unhealthy)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshtrain-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        self.waiting.put([request])

    def submit_group(self, requests: list[Request]) -> None:
        """The answers of one prompt (same prompt and settings): one prefill, then each its own.
        At most max_batch of them (the app refuses more)."""
        for i, request in enumerate(requests):
            request.seed_offset = i
        self.waiting.put(requests)

    def complete(self, prompt: list[int], params: SamplingParams) -> tuple[str, str, Request]:
        """Generate to the end, blocking: (text, finish reason "stop" or "length", the request with
        its tokens and log-probabilities)."""
        done, parts, finish = threading.Event(), [], []

        def emit(event: tuple) -> None:
            if event[0] == "text":
                parts.append(event[1])
            else:
                finish.append(event)
                done.set()

        request = Request(prompt, params, emit)
        self.submit(request)
        while not done.wait(timeout=1.0):
            if self.failure is not None:
                raise RuntimeError(f"the generation engine stopped: {self.failure}")
        if finish[0][0] == "error":
            raise RuntimeError(finish[0][1])
        return "".join(parts), finish[0][1], request

    def close(self) -> None:
        self._stop.set()
        self.waiting.put(None)  # wake the loop
        self._thread.join(timeout=10)

    # --- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        """The thread: a failure the loop could not contain (it should not happen) ends every
        request with an error and marks the engine failed, so that health checks and waiting
        clients see it instead of hanging."""
        try:
            self._loop()
        except BaseException as e:
            self.failure = f"{type(e).__name__}: {e}"
            for r in self.running + (self.held or []):
                self._finish(r, ("error", f"the generation engine stopped: {self.failure}"))
            while True:
                try:
                    request = self.waiting.get_nowait()
                except queue.Empty:
                    break
                for r in request or []:
                    r.emit(("error", f"the generation engine stopped: {self.failure}"))

    @torch.inference_mode()
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self.running)
            self.running = [r for r in self.running if not self._finished_or_cancelled(r)]
            if self.running:
                try:
                    self._decode()
                except Exception as e:  # a failure ends these requests, never the server
                    for r in self.running:
                        self._finish(r, ("error", f"generation failed: {e}"))
                    self.running = []

    def _admit(self, block: bool) -> None:
        """Waiting groups into free slots, in order: a group that needs more slots than are free is
        held, first in line, until enough are."""
        while self.free:
            if self.held is None:
                try:
                    self.held = self.waiting.get(block=block, timeout=None if block else 0)
                except queue.Empty:
                    return
                block = False
            group = [r for r in self.held or [] if not r.cancelled]
            if len(group) > len(self.free):
                return
            self.held = None
            if not group:
                continue
            for request in group:
                request.slot = self.free.pop()
                seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
                seed = _nth_seed(seed, request.seed_offset)
                request.generator = torch.Generator(device=self.device).manual_seed(seed)
            try:
                self._prefill(group)
            except Exception as e:  # these requests fail; their slots go back
                for request in group:
                    self._finish(request, ("error", f"generation failed: {e}"))
                    self._finished_or_cancelled(request)

    def _prefill(self, group: list[Request]) -> None:
        """One forward over the prompt: fills the first request's cache slot (copied into the
        others'), scores the prompt (echo with logprobs: echo alone returns the prompt's text, so
        its vocabulary-wide logits are not computed), samples each request's first token."""
        first, p = group[0], group[0].params
        scored = p.echo and p.logprobs is not None
        length = len(first.prompt)
        logits = forward_cached(
            self.model,
            self.cache,
            torch.tensor([first.prompt], device=self.device),
            torch.tensor([first.slot], device=self.device),
            torch.arange(length, device=self.device)[None],
            every_position=scored,
        )
        self.on_prefill(length)
        for keys, values in zip(self.cache.k, self.cache.v, strict=True):
            for other in group[1:]:
                keys[other.slot, :, :length] = keys[first.slot, :, :length]
                values[other.slot, :, :length] = values[first.slot, :, :length]
        if scored:  # position i predicts prompt token i + 1
            first.prompt_logprobs = [TokenLogprob(first.prompt[0], None)] + [
                self._logprob(logits[0, i], token, p.logprobs or 0) for i, token in enumerate(first.prompt[1:])
            ]
            logits = logits[:, -1]
        self.on_first_token(time.perf_counter() - first.submitted)
        for request in group:
            request.prompt_logprobs = first.prompt_logprobs
            if p.max_tokens == 0:  # scored only: it never joins the running batch, so its slot goes back here
                self._finish(request, ("done", "length"))
                self._finished_or_cancelled(request)
                continue
            self.running.append(request)
            self._accept(request, self._choose(logits[0], request))

    def _decode(self) -> None:
        batch = self.running
        tokens = torch.tensor([[r.generated[-1]] for r in batch], device=self.device)
        positions = torch.tensor([[len(r.prompt) + len(r.generated) - 1] for r in batch], device=self.device)
        slots = torch.tensor([r.slot for r in batch], device=self.device)
        logits = forward_cached(self.model, self.cache, tokens, slots, positions)
        greedy = logits.argmax(-1).tolist()  # one op for every plain temperature-0 request
        for i, request in enumerate(batch):
            p = request.params
            plain = (
                p.temperature <= 0
                and not (p.presence_penalty or p.frequency_penalty)
                and p.logprobs is None
                and not p.score
                and request.constraint is None
            )
            if plain:
                self._accept(request, greedy[i])
                continue
            try:
                token = self._choose(logits[i], request)
            except Exception as e:  # this request's sampling or grammar failed: it ends, the batch goes on
                self._finish(request, ("error", f"generation failed: {e}"))
                continue
            self._accept(request, token)

    def _choose(self, logits: torch.Tensor, request: Request) -> int:
        """The next token: penalties applied, the grammar's mask too, then greedy or sampled; its
        log-probability recorded (the model's, before any of them)."""
        p = request.params
        adjusted = logits.float()
        if request.constraint is not None:
            adjusted = adjusted.masked_fill(~request.constraint.allowed().to(adjusted.device), float("-inf"))
        if request.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(request.counts), device=logits.device)
            counts = torch.tensor(list(request.counts.values()), device=logits.device, dtype=adjusted.dtype)
            adjusted = adjusted.index_put((ids,), -(p.presence_penalty + p.frequency_penalty * counts), accumulate=True)
        token = int(adjusted.argmax()) if p.temperature <= 0 else self._sample(adjusted, request)
        if p.logprobs is not None:
            request.logprobs.append(self._logprob(logits, token, p.logprobs))
        if p.score and token not in self.eos_ids and token not in p.stop_ids:
            request.score += float(torch.log_softmax(logits.float(), -1)[token])
        return token

    @staticmethod
    def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits.float(), -1)
        best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
        alternatives = dict(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else {}
        return TokenLogprob(token, float(logprobs[token]), alternatives)

    def _sample(self, logits: torch.Tensor, request: Request) -> int:
        p = request.params
        # from the largest logit, in float64: any temperature above 0 (1e-300 too) leaves it at 0, not 0/0
        logits = (logits.double() - logits.max()) / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _accept(self, request: Request, token: int) -> None:
        """Add a sampled token, stream the new text, and finish on EOS, a stop string, a complete
        constrained answer or a limit."""
        if request.constraint is not None:
            try:
                request.constraint.take(token)
            except RuntimeError as e:  # the mask allowed it: a bug, which ends this request only
                return self._finish(request, ("error", f"generation failed: {e}"))
        if token in self.eos_ids or token in request.params.stop_ids:
            if request.params.logprobs is not None:
                request.logprobs.pop()  # the end of text is not part of the answer
            # what was held back for a stop string that never came (or a character left incomplete)
            self._emit_text(request, self.tokenizer.decode(request.generated))
            return self._finish(request, ("done", "stop"))
        request.generated.append(token)
        request.counts[token] = request.counts.get(token, 0) + 1
        self.on_tokens(1)
        text = self.tokenizer.decode(request.generated)
        stop_at = min((i for i in (text.find(s) for s in request.params.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            self._emit_text(request, text[:stop_at])
            return self._finish(request, ("done", "stop"))
        if request.constraint is not None and request.constraint.complete:
            self._emit_text(request, text)
            return self._finish(request, ("done", "stop"))
        if (
            len(request.generated) >= request.params.max_tokens
            or len(request.prompt) + len(request.generated) >= self.max_context
        ):
            self._emit_text(request, text)
            return self._finish(request, ("done", "length"))
        # Hold back an incomplete UTF-8 character and what could still become a stop string.
        hold = max((len(s) - 1 for s in request.params.stop), default=0)
        safe = text.rstrip("\ufffd")
        self._emit_text(request, safe[: len(safe) - hold] if hold else safe)

    def _emit_text(self, request: Request, text: str) -> None:
        if len(text) > len(request.text) and text.startswith(request.text):
            request.emit(("text", text[len(request.text) :]))
            request.text = text

    def _finish(self, request: Request, event: tuple) -> None:
        request.emit(event)
        request.cancelled = True  # leaves the running batch at the next step

    def _finished_or_cancelled(self, request: Request) -> bool:
        if request.cancelled and request.slot >= 0:
            self.free.append(request.slot)
            request.slot = -1
        return request.cancelled
