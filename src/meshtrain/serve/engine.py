"""The generation engine: continuous batching over a paged KV cache, in one background thread.

Each step of the engine thread:
1. admits waiting requests while the batch has room and the cache has the blocks their prompts
   need beyond what prefix caching already holds (a request that does not fit waits, first in line);
2. computes at most `prefill_chunk` prompt tokens (chunked prefill: a long prompt takes several
   steps, so it never stalls the running streams for its whole length); a prompt computed to its
   end samples its first token;
3. runs one batched decode forward for every running request, samples each one's next token with
   its own settings and generator, and streams the new text out.
A request takes a new block when its tokens fill the last one. When none is left, the latest
admitted request is preempted: its blocks go back (the full ones stay cached) and it is computed
again, prompt and answer so far, when memory frees (vLLM's recompute preemption); its answer goes on
exactly where it stopped. A finished or cancelled request (a client that went away) gives its
blocks back at the next step.

The n answers of one prompt (OpenAI's `n`, completions' `best_of`) are a group: admitted together,
prefilled once, then sharing the prompt's full blocks (the partial last one copied for each) and
sampled apart, each with its own generator. A request with a grammar (response_format,
serve/grammar.py) has its logits masked to the tokens that continue it, and ends when it is whole.
"""

from __future__ import annotations

import math
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshtrain.model import Llama
from meshtrain.model.kv_cache import PagedKVCache, forward_paged
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
    blocks: list[int] = field(default_factory=list)  # its block table in the KV cache
    names: list[int] = field(default_factory=list)  # prefix-cache names of its full blocks, in order
    computed: int = 0  # tokens of prompt + generated whose keys and values are in its blocks
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


@dataclass
class Prefill:
    """A group whose prompt is being computed, a chunk a step, into its first request's blocks up to
    `target` tokens (the prompt; for a preempted request, its prompt and answer but the last token,
    which the next decode step feeds). `copies`: each other request's block for the prompt's
    partial last block, taken at admission so that the group never waits half-forked."""

    group: list[Request]
    target: int
    copies: list[int]
    scored: bool  # echo with logprobs: every prompt position's logits, no prefix reused
    reused: int  # prompt tokens the prefix cache held at admission
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def resumed(self) -> bool:
        return bool(self.group[0].generated)


class Engine:
    def __init__(
        self,
        model: Llama,
        tokenizer,
        eos_ids: list[int] | int | None,
        max_batch: int,
        max_context: int,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = 512,
        prefix_caching: bool = True,
        on_first_token: Callable[[float], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        on_prefill: Callable[[int], None] | None = None,
    ):
        """kv_cache_tokens: the cache's size (default max_batch x max_context, what every request
        at its longest needs); at least max_context, so that any one request can always finish."""
        self.model, self.tokenizer = model.eval(), tokenizer
        # every token that ends a generation (Llama 3 instruct: <|eot_id|> and <|end_of_text|>)
        self.eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or ())
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.device = model.tok_embeddings.weight.device
        blocks = math.ceil((kv_cache_tokens or max_batch * max_context) / block_size)
        if blocks < math.ceil(max_context / block_size):
            raise ValueError(f"a KV cache of {kv_cache_tokens} tokens cannot hold one request of {max_context}")
        self.cache = PagedKVCache(model, blocks, block_size, prefix_caching)
        # admission leaves this many blocks for the running requests to grow into (vLLM's watermark)
        self.watermark = blocks // 100
        self.waiting: queue.Queue[list[Request] | None] = queue.Queue()
        self.held: list[Request] | None = None  # a group waiting for room (first in line)
        self.preempted: deque[list[Request]] = deque()  # admitted again before anything waiting
        self.prefilling: list[Prefill] = []
        self.running: list[Request] = []
        self.cached_tokens = 0  # prompt tokens read from the prefix cache instead of computed
        self.preemptions = 0
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
            stuck = [job.group for job in self.prefilling] + list(self.preempted) + [self.held or []]
            for r in self.running + [r for group in stuck for r in group]:
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
            self._admit(block=not (self.running or self.prefilling or self.preempted))
            self._drop_finished()
            if self.prefilling:
                self._prefill_step()
            if self.running:
                try:
                    self._decode()
                except Exception as e:  # a failure ends these requests, never the server
                    for r in self.running:
                        self._finish(r, ("error", f"generation failed: {e}"))
                    self._drop_finished()

    def queued(self) -> int:
        """Requests waiting for room in the batch or the cache (read from other threads: a snapshot)."""
        return self.waiting.qsize() + len(self.held or []) + sum(len(group) for group in list(self.preempted))

    def _drop_finished(self) -> None:
        self.running = [r for r in self.running if not self._finished_or_cancelled(r)]

    def _active(self) -> int:
        return len(self.running) + sum(len(job.group) for job in self.prefilling)

    def _admit(self, block: bool) -> None:
        """Preempted groups, then waiting ones, in order, while the batch has room and the cache
        the blocks: a group that does not fit is held, first in line, until it does."""
        while self._active() < self.max_batch:
            if self.preempted:
                group, source = self.preempted[0], self.preempted.popleft
            else:
                if self.held is None:
                    try:
                        self.held = self.waiting.get(block=block, timeout=None if block else 0)
                    except queue.Empty:
                        return
                    block = False
                group, source = self.held or [], lambda: setattr(self, "held", None)
            group = [r for r in group if not r.cancelled]
            if not group:
                source()
                continue
            if len(group) > self.max_batch - self._active():
                return
            try:
                job = self._reserve(group)
            except ValueError as e:  # it could never fit: it fails, the rest go on
                source()
                for request in group:
                    self._finish(request, ("error", str(e)))
                continue
            if job is None:
                return
            source()
            for request in group:
                if request.generator is None:
                    seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
                    seed = _nth_seed(seed, request.seed_offset)
                    request.generator = torch.Generator(device=self.device).manual_seed(seed)
            self.prefilling.append(job)

    def _reserve(self, group: list[Request]) -> Prefill | None:
        """The blocks of a group's prompt: the prefix cache's, and new ones for the rest; None (and
        nothing taken) when the cache has too few free now."""
        first, size = group[0], self.cache.block_size
        tokens = first.prompt + first.generated
        resumed = bool(first.generated)
        target = len(tokens) - 1 if resumed else len(tokens)
        scored = not resumed and first.params.echo and first.params.logprobs is not None
        copies = (len(group) - 1) * (target % size != 0)
        total = math.ceil(target / size) + copies
        if total > self.cache.blocks:
            raise ValueError(
                f"generation failed: {len(group)} answers of a {target}-token prompt need {total} KV-cache blocks "
                f"of {size} tokens; the server has {self.cache.blocks} (raise --kv-cache-gib)"
            )
        # a prompt's last token is always computed: its logits give the first token
        blocks, names = self.cache.match(tokens[: 0 if scored else target if resumed else target - 1])
        room = self.cache.available() - (self.watermark if self._active() else 0)
        if total - len(blocks) > room:
            self.cache.release(blocks)
            return None
        new = [self.cache.allocate() for _ in range(total - len(blocks))]
        first.blocks, first.names, first.computed = blocks + new[: len(new) - copies], names, len(blocks) * size
        return Prefill(group, target, new[len(new) - copies :], scored, first.computed)

    def _prefill_step(self) -> None:
        """At most prefill_chunk prompt tokens, first admitted first; a prompt computed to its end
        starts its group."""
        budget = self.prefill_chunk
        for job in list(self.prefilling):
            first = job.group[0]
            if all(r.cancelled for r in job.group):
                self.prefilling.remove(job)
                self._release(job)
                continue
            logits = None
            if first.computed < job.target:
                if budget == 0:
                    return
                n = min(job.target - first.computed, budget)
                try:
                    logits = self._compute(first, n, job.scored)
                except Exception as e:  # these requests fail; their blocks go back
                    self.prefilling.remove(job)
                    self._release(job)
                    for request in job.group:
                        self._finish(request, ("error", f"generation failed: {e}"))
                    continue
                budget -= n
                if job.scored:
                    job.logits.append(logits[0])
                if first.computed < job.target:
                    return
            self.prefilling.remove(job)
            if job.resumed:
                self.running.append(first)
            else:
                self._start(job, logits)

    def _compute(self, request: Request, n: int, every_position: bool) -> torch.Tensor:
        """The next n tokens of a request's prompt (and answer, when it is computed again) into its blocks."""
        start = request.computed
        tokens = (request.prompt + request.generated)[: start + n]
        logits = forward_paged(
            self.model,
            self.cache,
            torch.tensor([tokens[start:]], device=self.device),
            torch.tensor([request.blocks], device=self.device),
            torch.arange(start, start + n, device=self.device)[None],
            every_position=every_position,
        )
        request.computed += n
        self.on_prefill(n)
        self.cache.name_full_blocks(tokens, request.blocks, request.names, request.computed)
        return logits

    def _start(self, job: Prefill, logits: torch.Tensor) -> None:
        """A prompt computed: the other answers of its group take its blocks (the full ones shared,
        the partial last one copied), the prompt is scored when asked, each samples its first token."""
        group, first = job.group, job.group[0]
        p, size = first.params, self.cache.block_size
        full = first.blocks[: first.computed // size]
        for other, copy in zip(group[1:], job.copies or [None] * (len(group) - 1), strict=True):
            for block in full:
                self.cache.share(block)
            other.blocks, other.names, other.computed = full.copy(), first.names.copy(), first.computed
            if copy is not None:
                self.cache.copy_block(first.blocks[-1], copy)
                other.blocks.append(copy)
        if job.scored:  # position i predicts prompt token i + 1
            every = torch.cat(job.logits)
            first.prompt_logprobs = [TokenLogprob(first.prompt[0], None)] + [
                self._logprob(every[i], token, p.logprobs or 0) for i, token in enumerate(first.prompt[1:])
            ]
            logits = every[-1:]
        self.on_first_token(time.perf_counter() - first.submitted)
        self.cached_tokens += job.reused
        for request in group:
            request.prompt_logprobs = first.prompt_logprobs
            if p.max_tokens == 0:  # scored only: it never joins the running batch
                self._finish(request, ("done", "length"))
                continue
            self.running.append(request)
            try:
                token = self._choose(logits[0], request)
            except Exception as e:  # this request's sampling or grammar failed: it ends, the others go on
                self._finish(request, ("error", f"generation failed: {e}"))
                continue
            self._accept(request, token)

    def _grow(self) -> None:
        """A block for each running request whose blocks are full; when none is left, the latest
        admitted request is preempted until there is."""
        size, i = self.cache.block_size, 0
        while i < len(self.running):
            request = self.running[i]
            if request.computed < len(request.blocks) * size:
                i += 1
                continue
            block = self.cache.allocate()
            if block is not None:
                request.blocks.append(block)
                i += 1
                continue
            self._preempt_latest()

    def _preempt_latest(self) -> None:
        self.preemptions += 1
        if self.prefilling:
            job = self.prefilling.pop()
            self._release(job)
            self.preempted.appendleft(job.group)
            return
        request = self.running.pop()
        self.cache.release(request.blocks)
        request.blocks, request.names, request.computed = [], [], 0
        self.preempted.appendleft([request])

    def _release(self, job: Prefill) -> None:
        first = job.group[0]
        self.cache.release(first.blocks + job.copies)
        first.blocks, first.names, first.computed = [], [], 0

    def _decode(self) -> None:
        self._drop_finished()
        self._grow()
        batch = self.running
        if not batch:
            return
        tokens = torch.tensor([[r.generated[-1]] for r in batch], device=self.device)
        positions = torch.tensor([[r.computed] for r in batch], device=self.device)
        width = max(len(r.blocks) for r in batch)
        tables = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in batch], device=self.device)
        logits = forward_paged(self.model, self.cache, tokens, tables, positions)
        size = self.cache.block_size
        for r in batch:
            r.computed += 1
            if r.computed % size == 0:
                self.cache.name_full_blocks(r.prompt + r.generated, r.blocks, r.names, r.computed)
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
        request.cancelled = True  # leaves the running batch at the next step
        self._finished_or_cancelled(request)  # its blocks back before anyone hears it is done
        request.emit(event)

    def _finished_or_cancelled(self, request: Request) -> bool:
        if request.cancelled and request.blocks:
            self.cache.release(request.blocks)
            request.blocks = []
        return request.cancelled
