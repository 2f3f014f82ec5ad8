"""The serving engine's paged KV cache: blocks shared by prefix, admission that waits, preemption that
recomputes, chunked prefill. Every answer is compared with the same requests on a cache that never
runs short and shares nothing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshtrain.model import Llama, ModelArgs
from meshtrain.model.kv_cache import PagedKVCache
from meshtrain.serve.engine import Engine, Request, SamplingParams

VOCAB = 97


class Chars:  # a tokenizer stand-in: one character per id
    def decode(self, ids):
        return "".join(chr(0x100 + i) for i in ids)


@pytest.fixture(scope="module")
def model():
    model = Llama(
        ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=VOCAB, max_seq_len=2304)
    )
    model.init_weights(5)
    return model.eval()


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], answers: list[int] | None = None):
    """Submit every prompt at once (the i-th as a group of answers[i] answers) -> each answer's tokens."""
    done = threading.Semaphore(0)

    def emit(event):
        if event[0] != "text":
            assert event[0] == "done", event
            done.release()

    groups = [
        [Request(prompt, p, emit) for _ in range(n)]
        for prompt, p, n in zip(prompts, params, answers or [1] * len(prompts), strict=True)
    ]
    for group in groups:
        engine.submit_group(group)
    for _ in range(sum(map(len, groups))):
        assert done.acquire(timeout=120)
    return [r.generated for group in groups for r in group]


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0)


def test_blocks_are_shared_by_their_prefix_and_evicted_least_recently_used(model):
    cache = PagedKVCache(model, blocks=4, block_size=2)
    first = [cache.allocate() for _ in range(3)]
    names: list[int] = []
    cache.name_full_blocks([1, 2, 3, 4, 5], first, names, computed=5)
    assert len(names) == 2  # the partial third block has no name
    cache.release(first)
    assert cache.available() == 4 and len(cache.cached) == 2
    blocks, _ = cache.match([1, 2, 3, 4, 9])
    assert blocks == first[:2] and cache.refs[first[0]] == 1
    assert cache.match([3, 4])[0] == []  # a block is named by what comes before it too
    cache.release(blocks)
    cache.match([1, 2])  # [1, 2]'s block used last: [3, 4]'s is the least recently used
    cache.release([first[0]])
    taken = [cache.allocate() for _ in range(3)]  # the two free blocks, then the LRU cached one
    assert first[1] in taken and first[0] not in taken
    assert cache.match([1, 2, 3, 4])[0] == [first[0]]
    assert cache.allocate() is None  # every block held


def test_a_shared_system_prompt_is_computed_once_and_32_streams_fit_a_budget_slots_could_not(model):
    """32 requests sharing a 2,000-token system prompt. A cache of slots (max_context tokens each)
    would need 32 x 2,100 tokens; the paged one holds them all at once in 3,600, computes the shared
    prompt once, and answers exactly as an engine without prefix caching does."""
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, VOCAB, (2000,), generator=gen).tolist()
    prompts = [system + torch.randint(0, VOCAB, (8,), generator=gen).tolist() for _ in range(33)]
    params = [greedy(16)] * 33

    plain = Engine(model, Chars(), None, max_batch=32, max_context=2100, prefix_caching=False)
    expected = run(plain, prompts, params)
    plain.close()

    computed, peak = [0], [0]
    budget = 3600
    assert budget < 32 * 2100
    engine = Engine(
        model,
        Chars(),
        None,
        max_batch=32,
        max_context=2100,
        kv_cache_tokens=budget,
        on_prefill=lambda n: computed.__setitem__(0, computed[0] + n),
        on_tokens=lambda n: peak.__setitem__(0, max(peak[0], len(engine.running))),
    )
    assert run(engine, prompts[:1], params[:1]) == expected[:1]
    assert computed[0] == 2008
    computed[0] = 0
    assert run(engine, prompts[1:], params[1:]) == expected[1:]
    engine.close()
    assert peak[0] == 32, "all 32 streams ran together"
    assert engine.cached_tokens == 32 * 2000  # the system prompt's 125 full blocks, read by each of the 32
    assert computed[0] == 32 * 8  # each request's own tokens only
    assert engine.preemptions == 0


def test_requests_wait_for_room_and_a_preempted_answer_goes_on_where_it_stopped(model):
    """Seven answers that need 7 x 80 tokens on a cache of 128: they wait, the latest is preempted
    when the running ones grow, and is computed again; greedy and seeded answers (two of them one
    prompt's n = 2, sharing its blocks) equal those of a cache that never runs short. Prompts are
    prefilled 8 tokens a step."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (20,), generator=gen).tolist() for _ in range(6)]
    params = [greedy(60)] * 4 + [SamplingParams(max_tokens=60, temperature=1.0, top_k=20, seed=s) for s in (7, 8)]
    answers = [1, 1, 1, 1, 1, 2]
    roomy = Engine(model, Chars(), None, max_batch=7, max_context=128, block_size=8)
    expected = run(roomy, prompts, params, answers)
    roomy.close()
    tight = Engine(
        model, Chars(), None, max_batch=7, max_context=128, kv_cache_tokens=128, block_size=8, prefill_chunk=8
    )
    assert run(tight, prompts, params, answers) == expected
    tight.close()
    assert all(len(answer) == 60 for answer in expected) and expected[-1] != expected[-2]
    assert tight.preemptions > 0
    assert tight.cache.available() == tight.cache.blocks  # every block given back


@pytest.mark.parametrize("chunk, at_least, at_most", [(64, 20, 24), (4096, 0, 0)])
def test_a_long_prompt_is_prefilled_between_the_running_streams_steps(model, chunk, at_least, at_most):
    """A 1,500-token prompt arriving while a stream runs: in chunks of 64, the stream gets a token
    between every two of its 24 chunks; in one piece, none until the prompt is done."""
    events: list = []  # in the engine thread's order: prompt tokens computed, each request's text
    engine = Engine(
        model, Chars(), None, max_batch=2, max_context=2100, prefill_chunk=chunk, on_prefill=lambda n: events.append(n)
    )
    gen = torch.Generator().manual_seed(2)
    stream, long = (torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 1500))
    started, done = threading.Event(), threading.Semaphore(0)

    def emit(event, who):
        events.append((who, event[0]))
        started.set()
        if event[0] != "text":
            done.release()

    engine.submit(Request(stream, greedy(200), lambda e: emit(e, "stream")))
    assert started.wait(timeout=60)
    engine.submit(Request(long, greedy(1), lambda e: emit(e, "long")))
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    engine.close()
    first_chunk = next(i for i, e in enumerate(events) if isinstance(e, int) and e != 5)
    answered = events.index(("long", "text"))
    assert sum(e == chunk or e == 1500 % chunk for e in events[first_chunk:answered] if isinstance(e, int)) >= 1
    between = sum(e == ("stream", "text") for e in events[first_chunk:answered])
    assert at_least <= between <= at_most, between


def test_a_failure_choosing_a_first_token_ends_that_request_only(model):
    class Broken:  # a grammar whose mask fails
        complete = False

        def allowed(self):
            raise RuntimeError("no mask")

    engine = Engine(model, Chars(), None, max_batch=2, max_context=64)
    broken = Request([1, 2, 3], greedy(4), lambda e: None, constraint=Broken())
    ends = []
    broken.emit = ends.append
    engine.submit(broken)
    assert len(run(engine, [[4, 5, 6]], [greedy(4)])[0]) == 4  # submitted after it, answered in full
    engine.close()
    assert ends == [("error", "generation failed: no mask")] and engine.failure is None
    assert engine.cache.available() == engine.cache.blocks


@pytest.mark.parametrize("block_size, blocks, chunk", [(1, 36, 3), (4, 10, 5), (8, 5, 64)])
def test_random_traffic_on_a_tight_cache_answers_as_a_roomy_one_and_gives_every_block_back(
    model, block_size, blocks, chunk
):
    """Groups of answers, prompts scored with echo (their logits split over chunks), seeded sampling
    and requests cancelled while they run or wait, on caches of one request's context: every answer
    not cancelled, and every prompt score, equals a roomy cache's without prefix caching; afterwards
    no block is held and the reference counts are all zero. (Greedy tokens equal; the prompt scores
    within float rounding, computed in other chunks.)"""
    rng = torch.Generator().manual_seed(block_size)
    kinds = []
    for i in range(14):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 20, (1,), generator=rng)),), generator=rng).tolist()
        if i % 3 == 0:  # a shared start, for the prefix cache
            prompt = [7, 8, 9, 10, 11, 12, 13, 14] + prompt
        p = SamplingParams(max_tokens=int(torch.randint(1, 24, (1,), generator=rng)), temperature=0)
        if i % 4 == 1:
            p = SamplingParams(max_tokens=8, temperature=1.0, seed=i)
        if i % 5 == 2:
            p = SamplingParams(max_tokens=0, echo=True, logprobs=1)
        kinds.append((prompt, p, 1 + (i % 6 == 3)))

    def traffic(engine: Engine) -> list:
        done, groups = threading.Semaphore(0), []
        for i, (prompt, p, n) in enumerate(kinds):
            group = [Request(prompt, p, lambda e: e[0] != "text" and done.release()) for _ in range(n)]
            if i % 7 == 5:
                group[0].cancel()  # before it is admitted: it never answers
            if i % 7 == 4:  # its client goes away at its first token, while it runs
                group[0].emit = lambda e, r=group[0]: r.cancel()
            groups.append(group)
            engine.submit_group(group)
        answering = sum(not (i % 7 in (4, 5) and j == 0) for i, g in enumerate(groups) for j in range(len(g)))
        for _ in range(answering):
            assert done.acquire(timeout=120)
        time.sleep(0.1)  # a cancelled request's blocks go back at the engine's next step
        answered = [r for i, g in enumerate(groups) for j, r in enumerate(g) if not (i % 7 in (4, 5) and j == 0)]
        return [
            (r.generated, [t.token for t in r.prompt_logprobs], [t.logprob for t in r.prompt_logprobs[1:]])
            for r in answered
        ]

    roomy = Engine(model, Chars(), None, max_batch=4, max_context=32, prefix_caching=False)
    expected = traffic(roomy)
    roomy.close()
    tight = Engine(
        model,
        Chars(),
        None,
        max_batch=4,
        max_context=32,
        kv_cache_tokens=blocks * block_size,
        block_size=block_size,
        prefill_chunk=chunk,
    )
    got = traffic(tight)
    tight.close()
    assert [row[:2] for row in got] == [row[:2] for row in expected] and len(got) == 12 and tight.preemptions > 0
    for (_, _, scores), (_, _, reference) in zip(got, expected, strict=True):  # prompt scores, computed in chunks
        assert scores == pytest.approx(reference, abs=1e-5)
    assert tight.cache.available() == tight.cache.blocks and not any(tight.cache.refs)
