"""`meshtrain serve`: a real uvicorn server on a free loopback port, driven by the official `openai`
client and raw HTTP; answers compared with Hugging Face transformers' greedy generate() on the
exported model, KV-cache decoding with full recomputation, concurrent answers with lone ones."""

import enum
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Literal

import httpx
import pytest
import torch
from pydantic import BaseModel, Field

from conftest import assert_user_error, greedy_by_recomputation, run_cli, train_args
from meshtrain.errors import MeshtrainError
from meshtrain.model import Llama, ModelArgs
from meshtrain.serve import Engine, Request, SamplingParams, ServedModel, load_engine
from meshtrain.serve.chat import chat_prompt
from meshtrain.serve.requests import APIError, Message

KEY = "test-key"
PROMPTS = [
    "def ",
    "import os\n",
    "class Foo",
    "    return ",
    "for i in range(",
    "# ",
    "if x ==",
    "print(",
    "self.",
    "with open(",
    "try:\n    ",
    "from . import",
    "x = [",
    "while True:",
    "raise ",
    "@property\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def exported(corpus, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve-run")
    result = run_cli(
        train_args(corpus, run_dir, "--training.steps", "30", "--run.log_every", "10", "--model.max_seq_len", "1024"),
        cli_env,
    )  # room for long generations
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_dir.parent / "hf-served"
    assert run_cli(["export", str(run_dir), "--out", str(out)], cli_env).returncode == 0
    return out


def start_server(model_dir, cli_env, *extra):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtrain", "serve", str(model_dir), "--port", str(port), *extra],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the server did not come up within 120 s:\n" + proc.communicate()[1][-3000:])
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(exported, cli_env):
    proc, url = start_server(exported, cli_env, "--api-key", KEY, "--max-batch", "16")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_greedy(exported):
    """transformers' greedy generate() on the exported directory, decoded with its tokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(str(exported / "tokenizer.json"))
    eos = model.generation_config.eos_token_id

    def run(prompt: str, n: int) -> str:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        new = [t for t in out[0, ids.shape[1] :].tolist() if t != eos]
        return tok.decode(new)

    return run


def test_kv_cache_decoding_equals_full_recomputation():
    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, max_seq_len=64))
    model.init_weights(3)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (1, 5, 9, 17)]
    expected = [greedy_by_recomputation(model.eval(), p, 20) for p in prompts]

    class Chars:  # a tokenizer stand-in: one character per id
        def decode(self, ids):
            return "".join(chr(0x100 + i) for i in ids)

    engine = Engine(model, Chars(), eos_ids=None, max_batch=3, max_context=64)
    done, got = threading.Semaphore(0), [None] * len(prompts)
    requests = [
        Request(p, SamplingParams(max_tokens=20, temperature=0), lambda e: e[0] != "text" and done.release())
        for p in prompts
    ]
    for r in requests:  # four requests, three slots: the last one joins when a slot frees
        engine.submit(r)
    for _ in prompts:
        assert done.acquire(timeout=60)
    # a special token given as a stop string ends the answer at that token, which is left out
    ends = []
    stop_at = expected[0].index(expected[0][2])  # its first occurrence
    stopped = Request(
        prompts[0],
        SamplingParams(max_tokens=20, temperature=0, stop_ids=frozenset({expected[0][2]})),
        lambda e: e[0] != "text" and (ends.append(e), done.release()),
    )
    engine.submit(stopped)
    assert done.acquire(timeout=60)
    # ended by a stop token, the text held back for a longer stop string that never came is sent
    # the prompt and token whose first occurrence comes latest
    at, i, last = max((seq.index(t), i, t) for i, seq in enumerate(expected) for t in seq)
    texts = []
    held = Request(
        prompts[i],
        SamplingParams(max_tokens=20, temperature=0, stop=["zzzz"], stop_ids=frozenset({last})),
        lambda e: texts.append(e[1]) if e[0] == "text" else done.release(),
    )
    engine.submit(held)
    assert done.acquire(timeout=60)
    engine.close()
    assert at > 3, expected  # more text than the 3 characters held back
    assert "".join(texts) == Chars().decode(expected[i][:at])
    got = [r.generated for r in requests]
    assert got == expected
    assert stopped.generated == expected[0][:stop_at] and ends[-1] == ("done", "stop")


def test_echo_scores_the_prompt_only_where_logprobs_are_asked():
    """echo alone returns the prompt's text (OpenAI): its vocabulary-wide logits over every prompt
    position are not computed; echo with logprobs scores each prompt token after the first. Both
    requests are max_tokens 0 on an engine of one slot: a scored-only request gives its slot back
    (it used to keep it, and the second request waited forever)."""
    model = Llama(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50, max_seq_len=32))
    model.init_weights(0)
    engine = Engine(model.eval(), None, eos_ids=None, max_batch=1, max_context=32)
    done, prompt = threading.Semaphore(0), list(range(1, 9))
    scored = {}
    for logprobs in (None, 0):
        request = Request(prompt, SamplingParams(max_tokens=0, echo=True, logprobs=logprobs), lambda e: done.release())
        engine.submit(request)
        assert done.acquire(timeout=60)
        scored[logprobs] = request.prompt_logprobs
    engine.close()
    assert scored[None] == []
    assert [e.token for e in scored[0]] == prompt and scored[0][0].logprob is None
    assert all(e.logprob is not None and e.logprob < 0 for e in scored[0][1:])


def test_completions_and_chat_equal_transformers_greedy(client, exported, hf_greedy):
    for prompt in PROMPTS[:3]:
        expected = hf_greedy(prompt, 24)
        whole = client.completions.create(model="hf-served", prompt=prompt, max_tokens=24, temperature=0)
        assert whole.choices[0].text == expected
        assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 0
        assert whole.choices[0].finish_reason in ("stop", "length")
        stream = client.completions.create(model="hf-served", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f():"}]
    rendered = AutoTokenizer.from_pretrained(exported).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    expected = hf_greedy(rendered, 16)
    chat = client.chat.completions.create(model="hf-served", messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="hf-served",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_sampling_options_seed_stop_and_length(client):
    a = client.completions.create(
        model="hf-served", prompt="def ", max_tokens=20, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 40}
    )
    b = client.completions.create(
        model="hf-served", prompt="def ", max_tokens=20, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 40}
    )
    assert a.choices[0].text == b.choices[0].text  # the seed fixes the sample
    full = client.completions.create(model="hf-served", prompt="import os\n", max_tokens=30, temperature=0)
    text = full.choices[0].text
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 30
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        cut = client.completions.create(
            model="hf-served", prompt="import os\n", max_tokens=30, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_equal_their_lone_answers(client):
    alone = {
        p: client.completions.create(model="hf-served", prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in PROMPTS
    }
    results = {}

    def ask(prompt):
        stream = client.completions.create(model="hf-served", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        results[prompt] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == alone


def counter(url: str, name: str) -> float:
    """A Prometheus counter of the server's /metrics (meshtrain_<name>_total)."""
    line = next(
        x for x in httpx.get(url + "/metrics", timeout=30).text.splitlines() if x.startswith(f"meshtrain_{name}_total")
    )
    return float(line.split()[-1])


def test_n_answers_share_one_prefill_and_best_of_returns_the_likeliest(server, client):
    """n = 4 sampled answers of one prompt: one prefill, four different answers, each the one its seed
    gives (the first is the n = 1 answer; a stream of n = 2 gives the first two); at temperature 0
    all equal the greedy one. best_of = 3 returns the answer of the three with the highest mean
    log-probability per token, and bills all three."""
    ask = {"model": "hf-served", "prompt": "def ", "max_tokens": 12, "temperature": 1.0, "seed": 3}
    before = counter(server, "prefilled_tokens")
    four = client.completions.create(**ask, n=4)
    assert counter(server, "prefilled_tokens") - before == four.usage.prompt_tokens  # once for the four
    texts = [c.text for c in four.choices]
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and len(set(texts)) > 1, texts
    assert [c.text for c in client.completions.create(**ask, n=4).choices] == texts
    assert client.completions.create(**ask).choices[0].text == texts[0]
    parts = {}
    for chunk in client.completions.create(**ask, n=2, stream=True):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
    assert parts == {0: texts[0], 1: texts[1]}
    greedy = {"model": "hf-served", "messages": HI, "max_tokens": 8, "temperature": 0}
    alone = client.chat.completions.create(**greedy).choices[0].message.content
    assert [c.message.content for c in client.chat.completions.create(**greedy, n=3).choices] == [alone] * 3

    ranked = client.completions.create(**{**ask, "seed": 5}, n=3, logprobs=0).choices
    means = [sum(c.logprobs.token_logprobs) / max(1, len(c.logprobs.token_logprobs)) for c in ranked]
    best = client.completions.create(**{**ask, "seed": 5}, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].text == ranked[means.index(max(means))].text
    assert best.usage.completion_tokens == sum(len(c.logprobs.token_logprobs) for c in ranked)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=10)


class Role(enum.StrEnum):
    admin = "admin"
    guest = "guest"


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: str | None = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    """Nested objects, an enum, arrays and optional fields, every string and number bounded so that
    a random answer ends within max_tokens: the grammar, not the model, makes it valid."""

    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=130)
    role: Role
    pets: list[Pet] = Field(max_length=3)
    address: Address
    nickname: str | None = Field(max_length=8)


def test_json_schema_and_json_object_answers_always_parse(server, client):
    """A model trained on Python code, sampled at temperature 1: 25 `parse` answers and 25 streamed
    ones of a pydantic schema all validate; json_object answers are JSON objects. A schema the
    server cannot enforce is a 400 naming the field, and the server serves on."""
    from concurrent.futures import ThreadPoolExecutor

    from openai.lib._parsing._completions import type_to_response_format_param

    ask = {"model": "hf-served", "messages": [{"role": "user", "content": "a person"}], "max_tokens": 400}

    def parsed(seed: int) -> Person:
        reply = client.chat.completions.parse(**ask, response_format=Person, temperature=1.0, seed=seed)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.parsed

    def streamed(seed: int) -> Person:
        fmt = type_to_response_format_param(Person)
        chunks = client.chat.completions.create(**ask, response_format=fmt, temperature=1.0, seed=seed, stream=True)
        return Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    with ThreadPoolExecutor(8) as pool:
        people = list(pool.map(parsed, range(25))) + list(pool.map(streamed, range(25, 50)))
    assert all(isinstance(p, Person) for p in people) and len({p.model_dump_json() for p in people}) > 40
    unconstrained = (
        client.chat.completions.create(**{**ask, "max_tokens": 30}, temperature=0).choices[0].message.content
    )
    with pytest.raises(ValueError):
        json.loads(unconstrained)  # the model alone writes code, not JSON
    # json_object bounds nothing: an answer the limit cuts short ends "length", any other is an object
    for prompt in ("hi", "def f():", "{"):
        reply = client.chat.completions.create(
            **{**ask, "messages": [{"role": "user", "content": prompt}], "max_tokens": 60},
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=1,
        ).choices[0]
        text = reply.message.content
        assert text.startswith("{") and (reply.finish_reason == "length" or isinstance(json.loads(text), dict)), text

    auth = {"Authorization": f"Bearer {KEY}"}
    schema = {"name": "p", "schema": Person.model_json_schema()}
    for response_format, param in [
        ({"type": "json_schema", "json_schema": {**schema, "schema": {"type": "strin"}}}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {**schema, "strict": "yes"}}, "json_schema.strict"),
        ({"type": "json_schema", "json_schema": {**schema, "schema": {"$ref": "#/$defs/x"}}}, "json_schema.schema"),
        (
            {
                "type": "json_schema",
                "json_schema": {**schema, "schema": {"type": "integer", "minimum": 5, "maximum": 2}},
            },
            "schema",
        ),
        ({"type": "json_schema", "json_schema": {**schema, "extra": 1}}, "response_format.json_schema"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_object", "schema": {}}, "response_format"),
        ({"type": "yaml"}, "response_format.type"),
    ]:
        body = {**ask, "response_format": response_format}
        refused = httpx.post(server + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert refused.status_code == 400 and param in refused.json()["error"]["param"], refused.text
    assert isinstance(parsed(99), Person)  # still serving


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: Literal["fr", "de", "jp"]


class Weather(BaseModel):
    place: Place  # a nested model: the schema's $defs, which the calls' grammar keeps at its root
    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=7)


class Lookup(BaseModel):
    query: str = Field(max_length=20)


def test_required_and_named_tool_calls_validate_and_a_tool_result_round_trips(server, client):
    """tool_choice "required" (two functions) gives tool_calls whose arguments validate against the
    chosen function's schema in 50 of 50 answers, streamed and not; a named function is the one
    called; the call and its tool result sent back are rendered into the next prompt; "auto" lets a
    model that never learnt tools answer in text; bad tool fields are 400s naming the field."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import BadRequestError, pydantic_function_tool

    tools = [pydantic_function_tool(Weather, name="get_weather"), pydantic_function_tool(Lookup, name="lookup")]
    schemas = {"get_weather": Weather, "lookup": Lookup}
    ask = {"model": "hf-served", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 120}
    required = {**ask, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0}

    def called(seed: int) -> tuple[str, str]:
        choice = client.chat.completions.create(**required, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        schemas[call.function.name].model_validate_json(call.function.arguments)
        return call.function.name, call.function.arguments

    def streamed(seed: int) -> tuple[str, str]:
        parts, finish = {}, None
        for chunk in client.chat.completions.create(**required, seed=seed, stream=True):
            delta = chunk.choices[0].delta
            assert not delta.content, delta  # a required call is no text
            for call in delta.tool_calls or []:
                parts[call.index] = (call.function.name, call.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and list(parts) == [0]
        schemas[parts[0][0]].model_validate_json(parts[0][1])
        return parts[0]

    with ThreadPoolExecutor(8) as pool:
        calls = list(pool.map(called, range(25))) + list(pool.map(streamed, range(25, 50)))
    assert {name for name, _ in calls} == {"get_weather", "lookup"} and len(set(calls)) > 40
    named = {**required, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    forced = client.chat.completions.create(**{**named, "parallel_tool_calls": True}).choices[0]
    assert [c.function.name for c in forced.message.tool_calls] == ["lookup"] and forced.finish_reason == "stop"

    call = client.chat.completions.create(**required, seed=7).choices[0].message.tool_calls[0]
    conversation = [
        *ask["messages"],
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    answered = client.chat.completions.create(**{**ask, "messages": conversation}, tools=tools, temperature=0)
    alone = client.chat.completions.create(**ask, tools=tools, temperature=0)
    assert answered.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result are in it
    auto = alone.choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length") and auto.message.content

    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    for fields, param in [
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": bad_tools, "tool_choice": "auto"}, "tools.0.function.parameters"),
        ({"tools": [tools[0], tools[0]]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": tools, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": conversation[:1] + conversation[2:]}, "messages.1.tool_call_id"),
    ]:
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(**{**ask, **fields})
        assert refused.value.body["param"] == param, refused.value.body
    assert called(99)[0] in schemas  # still serving


def test_tool_calls_are_read_in_each_family_s_format_and_streams_hold_them_back():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshtrain.serve.chat import ToolUse
    from meshtrain.serve.grammar import grammar_tokenizer, schema_grammar
    from meshtrain.serve.tools import HERMES, LLAMA, CallStream, parse_answer, tool_format

    def known(*names):
        return lambda name, arguments: name in names

    assert tool_format("{{ '<tool_call>' }}") == HERMES and tool_format("<|python_tag|>") == LLAMA
    assert tool_format("{{ messages }}") is None
    hermes = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    parsed = parse_answer(hermes + second, HERMES, known("f", "g"))
    assert parsed.content == "Let me look." and [c["function"]["name"] for c in parsed.calls] == ["f", "g"]
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"a": 1}
    assert parse_answer(hermes, HERMES, known("g")).calls == []  # an unknown function: the text is content
    assert parse_answer(hermes.replace("}}", "}"), HERMES, known("f")).content == hermes.replace("}}", "}")
    llama = '<|python_tag|>{"name": "f", "parameters": {"a": "x; y"}}; {"name": "g", "parameters": {}}'
    parsed = parse_answer(llama, LLAMA, known("f", "g"))
    assert parsed.content is None and [c["function"]["name"] for c in parsed.calls] == ["f", "g"]
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"a": "x; y"}
    assert parse_answer("It is {sunny}.", LLAMA, known("f")).calls == []
    assert parse_answer(llama + " and more", LLAMA, known("f", "g")).calls == []

    # a strict function's arguments are held to its schema after the fact where the model chose to call
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator([hermes] * 4, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    vocab = grammar_tokenizer(tokenizer, tokenizer.get_vocab_size(), [0])
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    strict = {"f": schema_grammar(schema, vocab, "x"), "g": None}
    tools = ToolUse(HERMES, [], None, strict, vocab, parallel=False, named=False)
    assert tools.valid("f", {"a": 1}) and not tools.valid("f", {"a": "1"}) and not tools.valid("f", {})
    assert tools.valid("g", {"anything": [1]}) and not tools.valid("h", {})
    assert tools.read(hermes.replace('{"a": 1}', '{"a": "one"}')).calls == []
    assert [c["function"]["name"] for c in tools.read(hermes + second).calls] == [
        "f"
    ]  # parallel_tool_calls false: the first

    stream = CallStream(HERMES, lambda text: parse_answer(text, HERMES, known("f")))
    sent = [
        stream.feed(p) for p in ["Let me", " look.\n<tool", "_call>\n{", '"name": "f", "arguments": {}}\n</tool_call>']
    ]
    assert sent == ["Let me", " look.\n", "", ""] and stream.finish()[1][0]["function"]["name"] == "f"
    stream = CallStream(LLAMA, lambda text: parse_answer(text, LLAMA, known("f")))
    assert [stream.feed(p) for p in [" ", "It", " is"]] == ["", " It", " is"] and stream.finish() == ("", [])
    stream = CallStream(LLAMA, lambda text: parse_answer(text, LLAMA, known("f")))
    assert stream.feed('{"name": "x"') == "" and stream.finish() == ('{"name": "x"', [])


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ({}, {"model": "hf-served", "prompt": "x"}, 401, "authentication_error"),
    ({"Authorization": "Bearer wrong"}, {"model": "hf-served", "prompt": "x"}, 401, "authentication_error"),
    (None, {"model": "gpt-4", "prompt": "x"}, 404, "not_found_error"),
    (None, {"model": "hf-served", "prompt": "x " * 1100}, 400, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "max_tokens": 100000}, 400, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": ""}, 400, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "n": 17}, 400, "invalid_request_error"),  # over --max-batch 16
    (None, {"model": "hf-served", "prompt": "x", "best_of": 17}, 400, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "n": 3, "best_of": 2}, 400, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "n": 0}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": ["a", "b"]}, 400, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "max_tokens": "many"}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "temperature": 5}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": 3}, 422, "invalid_request_error"),
    (None, {"prompt": "x"}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "messages": []}, 422, "invalid_request_error"),
    # strict types: a string or a boolean where a number belongs is refused, not read as one
    (None, {"model": "hf-served", "prompt": "x", "temperature": "0.5"}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": "x", "top_k": True}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "prompt": [True, False]}, 422, "invalid_request_error"),
    (None, {"model": "hf-served", "messages": HI, "stream": "true"}, 422, "invalid_request_error"),
]


def test_bench_serve_counts_every_token_of_every_stream(server, client, exported):
    """`meshtrain bench serve`'s load: 3 clients x 2 streamed requests; the tokens it counts are
    those the same greedy requests return whole, and its latencies lie within the run."""
    from meshtrain.serve.loadtest import QUESTIONS, benchmark, measure_load

    row = measure_load(server, "hf-served", QUESTIONS[:3], clients=3, per_client=2, max_tokens=8, api_key=KEY)
    whole = [
        client.completions.create(model="hf-served", prompt=q, max_tokens=8, temperature=0).usage.completion_tokens
        for q in QUESTIONS[:3]
    ]
    assert (row["requests"], row["tokens"]) == (6, 2 * sum(whole))
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"])
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] < row["wall_s"]
    assert max(whole) > 1 and 0 < row["itl_p50_s"] <= row["itl_p99_s"] < row["wall_s"]
    with pytest.raises(
        MeshtrainError, match=r"need a context of 50\d\d tokens; the model's max_position_embeddings is 1024"
    ):
        benchmark(exported, ["meshtrain"], [1], system_tokens=5000, max_tokens=8)  # before any server starts


@pytest.mark.parametrize("headers, body, status, kind", BAD)
def test_bad_requests_get_openai_errors(server, headers, body, status, kind):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(
        server + path, json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"} if headers is None else headers
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and error["message"]


NO_EFFECT = [  # inputs that used to be accepted and silently dropped: (path, body, param, message)
    (
        "/v1/completions",
        {"prompt": "x", "best_of": 3, "temperature": 0},
        "best_of",
        "best_of picks among sampled answers, but temperature 0 decodes greedily (every answer the same): drop it, "
        "or sample (temperature > 0)",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "best_of": 3, "stream": True},
        "best_of",
        "best_of: more answers than n are ranked with stream: false only",
    ),
    (
        "/v1/chat/completions",
        {"messages": [*HI, {"role": "user", "content": "x", "name": "bob"}]},
        "messages.1.name",
        "messages[1].name is not supported by this model's chat template: drop it",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
        "stream_options is only allowed when stream is true: leave it out or set stream",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "stream_options": {"include_usage": True}, "stream": False},
        "stream_options",
        "stream_options is only allowed when stream is true: leave it out or set stream",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "stream": True, "stream_options": {"include_usage": True, "continuous_usage": True}},
        "stream_options.continuous_usage",
        "stream_options.continuous_usage: this server does not support this parameter; leave it out",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "max_tokens": 3, "max_completion_tokens": 4},
        "max_completion_tokens",
        "max_tokens (3) and max_completion_tokens (4) differ: send only max_completion_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "temperature": 0, "top_k": 5},
        "top_k",
        "top_k shapes sampling, but temperature 0 decodes greedily: drop it, or sample (temperature > 0)",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "temperature": 0, "top_p": 0.1, "seed": 1},
        "top_p",
        "top_p shapes sampling, but temperature 0 decodes greedily: drop it, or sample (temperature > 0)",
    ),
]


@pytest.mark.parametrize("path, body, param, message", NO_EFFECT)
def test_inputs_that_would_have_no_effect_are_refused(server, path, body, param, message):
    auth = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(server + path, json={"model": "hf-served", **body}, headers=auth, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")


def test_agreeing_max_tokens_and_an_empty_name_are_accepted(client):
    chat = client.chat.completions.create(
        model="hf-served",
        messages=[{"role": "user", "content": "hi", "name": ""}],
        max_tokens=3,
        max_completion_tokens=3,
        temperature=0,
    )
    assert 1 <= chat.usage.completion_tokens <= 3


def test_a_name_the_chat_template_renders_reaches_the_prompt():
    named = (
        "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n{% endfor %}"
    )
    served = ServedModel("m", None, None, [], None, named)
    messages = [Message(role="system", content="be brief"), Message(role="user", content="hi", name="bob")]
    assert chat_prompt(served, messages) == "system: be brief\nuser (bob): hi\n"
    served.chat_template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.name }}{% endif %}{% endfor %}"
    with pytest.raises(APIError, match=r"messages\[0\]\.name is not supported"):  # rendered for users only
        chat_prompt(served, [Message(role="system", content="x", name="a"), *messages[1:]])


def test_a_chat_templates_own_refusal_is_a_400_and_its_date_is_today(tmp_path):
    """Templates call transformers' raise_exception (Mistral's: roles must alternate) and strftime_now
    (Llama 3.1's date line); a refusal is the client's error, not the server's."""
    from datetime import datetime

    from meshtrain.data.chat import template_of

    strict = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{{ m.content }}\n{% endfor %}"
        "{{ strftime_now('%d %b %Y') }}"
    )
    served = ServedModel("m", None, None, [], None, strict)
    ok = chat_prompt(served, [Message(role="user", content="hi")])
    assert ok == f"hi\n{datetime.now().strftime('%d %b %Y')}"
    with pytest.raises(APIError, match="refuses this conversation: roles must alternate") as refused:
        chat_prompt(served, [Message(role="user", content="a"), Message(role="user", content="b")])
    assert refused.value.status == 400
    served.chat_template = "{{ messages[0].content.no_such_method() }}"
    with pytest.raises(APIError, match="the chat template fails on this conversation"):
        chat_prompt(served, [Message(role="user", content="a")])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]})
    )
    with pytest.raises(MeshtrainError, match="named templates \\(tool_use\\) with none named 'default'"):
        template_of(tmp_path)


@pytest.mark.parametrize(
    "device, message",
    [
        (
            "neuron",
            "--device neuron is not supported by serve and generate (CUDA or the CPU only); use auto, cuda or cpu",
        ),
        ("cuda", "--device cuda but no CUDA device is visible; use auto or cpu"),
    ],
)
def test_a_device_the_engine_cannot_use_is_refused_before_loading(device, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the machine without a GPU, anywhere
    with pytest.raises(MeshtrainError) as refused:
        load_engine("/nonexistent/model", device=device)  # refused before the path is even looked at
    assert str(refused.value) == message


def test_survives_malformed_bursts_and_abrupt_disconnects(server, client):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bodies = [b"{bad", b"[]", b'{"model": 1}', b"\xff\xfe", b'{"model":"hf-served","prompt":{"a":1}}']
    with httpx.Client(base_url=server, timeout=30) as http:
        statuses = {
            http.post("/v1/completions", content=bodies[i % len(bodies)], headers=auth).status_code for i in range(200)
        }
    assert statuses <= {400, 422}
    before = counter(server, "generated_tokens")
    body = json.dumps(
        {"model": "hf-served", "prompt": "def ", "max_tokens": 900, "temperature": 0, "stream": True}
    ).encode()
    host, port = server.removeprefix("http://").split(":")
    for _ in range(50):  # read the headers and the first bytes of a stream, then hang up
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + KEY.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            assert s.recv(256).startswith(b"HTTP/1.1 200")
    wait_until_idle(server)
    assert counter(server, "generated_tokens") - before < 50 * 900 / 4  # the abandoned streams stopped early
    answer = client.completions.create(model="hf-served", prompt="def ", max_tokens=5, temperature=0)
    assert answer.usage.completion_tokens >= 1
    metrics = httpx.get(server + "/metrics").text
    assert 'meshtrain_requests_total{path="/v1/completions",status="400"}' in metrics
    assert "meshtrain_time_to_first_token_seconds_count" in metrics


def wait_until_idle(url: str) -> None:
    deadline = time.monotonic() + 60
    while "meshtrain_running_requests 0.0" not in httpx.get(url + "/metrics").text:
        assert time.monotonic() < deadline, "the running batch did not empty"
        time.sleep(0.1)


def test_a_disconnected_client_frees_its_only_slot(exported, cli_env):
    proc, url = start_server(exported, cli_env, "--max-batch", "1")
    try:
        body = {"model": "hf-served", "prompt": "def ", "max_tokens": 1000, "temperature": 0, "stream": True}
        control = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 300, "stream": False}, timeout=120)
        assert control.json()["usage"]["completion_tokens"] == 300  # greedy "def " runs on without EOS
        before = counter(url, "generated_tokens")
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            next(response.iter_lines())
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting for a whole answer
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        answer = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 3, "stream": False}, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        wait_until_idle(url)
        assert (
            counter(url, "generated_tokens") - before < 1000
        )  # both abandoned requests stopped when their clients left
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_generate_streams_to_the_terminal(exported, cli_env, hf_greedy, tmp_path):
    result = run_cli(
        ["generate", str(exported), "--prompt", "def ", "--max-tokens", "12", "--temperature", "0"], cli_env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip("\n") == "def " + hf_greedy("def ", 12)
    # left out, the sampling is the model's generation_config.json's, as serve takes it: greedy here
    greedy = tmp_path / "greedy"
    shutil.copytree(exported, greedy)
    config = json.loads((greedy / "generation_config.json").read_text())
    (greedy / "generation_config.json").write_text(json.dumps({**config, "temperature": 0, "max_new_tokens": 7}))
    result = run_cli(["generate", str(greedy), "--prompt", "def ", "--top-k", "5"], cli_env)
    assert_user_error(result, "--top-k shapes sampling, but the model's generation_config.json decodes greedily")
    result = run_cli(["generate", str(greedy), "--prompt", "def "], cli_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip("\n") == "def " + hf_greedy("def ", 7)
    assert "generation_config.json: temperature 0" in result.stderr and "max_new_tokens 7" in result.stderr


def hf_logprobs(exported, ids: list[int]) -> torch.Tensor:
    """log-softmax over the vocabulary at every position, from transformers on the exported model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_logprobs_echo_penalties_and_content_parts(server, client, exported):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(exported / "tokenizer.json"))
    prompt = "def add(a, b):\n    return a + b\n"
    ids = tok.encode(prompt).ids
    auth = {"Authorization": f"Bearer {KEY}"}
    scored = httpx.post(
        server + "/v1/completions",
        json={"model": "hf-served", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2},
        headers=auth,
        timeout=60,
    ).json()["choices"][0]
    assert scored["text"] == prompt
    reference = hf_logprobs(exported, ids)
    lp = scored["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    for i, got in enumerate(lp["token_logprobs"][1:]):  # what lm-evaluation-harness sums
        assert abs(got - reference[i, ids[i + 1]].item()) <= 1e-3
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])

    answer = client.completions.create(model="hf-served", prompt="def ", max_tokens=6, temperature=0, logprobs=3)
    lp = answer.choices[0].logprobs
    assert len(lp.token_logprobs) == answer.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and abs(chosen - max(top.values())) < 1e-6  # greedy: the likeliest

    chat = client.chat.completions.create(
        model="hf-served",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    parts = client.chat.completions.create(
        model="hf-served",
        messages=[{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
        max_tokens=5,
        temperature=0,
    )
    assert parts.choices[0].message.content == chat.choices[0].message.content

    def most_repeated(**penalty) -> int:
        text = client.completions.create(model="hf-served", prompt="x = [", max_tokens=40, temperature=0, **penalty)
        ids = tok.encode(text.choices[0].text).ids
        return max(ids.count(t) for t in set(ids))

    assert most_repeated(frequency_penalty=2.0) < most_repeated()
    unbounded = client.chat.completions.create(
        model="hf-served", messages=[{"role": "user", "content": "def "}], temperature=0
    )  # no max_tokens: to the end of the context, not OpenAI completions' 16
    assert unbounded.choices[0].finish_reason == "stop" or unbounded.usage.completion_tokens > 16


def test_openai_fields_take_effect_or_are_refused(server, client):
    """A developer message is a system message; a special token as a stop string is matched as a
    token, one inside a longer stop string is refused; completions' logprobs is a count (true/false
    refused); echo alone returns the prompt's text without scores (OpenAI)."""
    user = {"role": "user", "content": "def f():"}

    def answer(role: str) -> str:
        messages = [{"role": role, "content": "be brief"}, user]
        reply = client.chat.completions.create(model="hf-served", messages=messages, max_tokens=12, temperature=0)
        return reply.choices[0].message.content

    assert answer("developer") == answer("system")
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(**fields) -> httpx.Response:
        body = {"model": "hf-served", "prompt": "def ", "max_tokens": 4, **fields}
        return httpx.post(server + "/v1/completions", json=body, headers=auth, timeout=60)

    assert (
        post(stop=["<|endoftext|>"], temperature=0).json()["choices"][0]["text"]
        == post(temperature=0).json()["choices"][0]["text"]
    )
    refused = post(stop=["\n<|endoftext|>"])
    assert refused.status_code == 400 and "special token '<|endoftext|>'" in refused.text
    for flag in (True, False):
        assert post(logprobs=flag).status_code in (400, 422)
    echoed = post(echo=True, temperature=0).json()["choices"][0]
    assert echoed["text"].startswith("def ") and echoed["logprobs"] is None
    # null, where OpenAI types a field "X or null", is its default (as the openai client may send it)
    nulls = dict.fromkeys(("n", "stream", "presence_penalty", "frequency_penalty", "echo", "best_of", "logprobs"))
    assert post(temperature=0, **nulls).json()["choices"][0]["text"] == post(temperature=0).json()["choices"][0]["text"]
    chat = {"model": "hf-served", "messages": [user], "max_tokens": 4, "temperature": 0}

    def chat_reply(**fields) -> dict:
        return httpx.post(server + "/v1/chat/completions", json={**chat, **fields}, headers=auth, timeout=60).json()

    assert chat_reply(logprobs=None, n=None, frequency_penalty=None)["choices"] == chat_reply()["choices"]
    # any temperature above 0 samples, however small: the largest logit's token, not a 500
    for tiny in (1e-40, 1e-300):
        assert (
            post(temperature=tiny, seed=1).json()["choices"][0]["text"]
            == post(temperature=0).json()["choices"][0]["text"]
        )


def hostile_requests(rng) -> list[tuple[str, bytes]]:
    """300+ malformed or hostile bodies: wrong types, out-of-range and huge numbers, bad encodings,
    nested JSON, unknown and unsupported fields, oversized prompts."""
    weird = [None, True, -1, 0, 2**64, 10**100, -(2**63), 1.5e308, "x", "", [], {}, [1, [2, [3]]], {"a": {"b": {}}}]
    fields = [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "n",
        "stream",
        "logprobs",
        "echo",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "stream_options",
        "best_of",
        "suffix",
        "user",
    ]
    requests = []
    for field in fields:
        for value in weird:
            body = {"model": "hf-served", "prompt": "def ", "max_tokens": 4, field: value}
            requests.append(("/v1/completions", json.dumps(body).encode()))
    chat_extras = [
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
        {"tool_choice": "auto"},
        {"top_logprobs": 3},
        {"logprobs": "yes"},
        {"functions": []},
    ]
    for extra in chat_extras:
        body = {"model": "hf-served", "messages": [{"role": "user", "content": "hi"}], **extra}
        requests.append(("/v1/chat/completions", json.dumps(body).encode()))
    messages = [
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        ["hi"],
        [[]],
    ]
    for m in messages:
        requests.append(("/v1/chat/completions", json.dumps({"model": "hf-served", "messages": m}).encode()))
    raw = [
        b'{"model": "hf-served", "prompt": "\\ud800"}',
        b'{"model": "hf-served", "prompt": "a\\udfffb"}',
        b'{"model": "hf-served", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        b"\xff\xfe\x00",
        b"[" * 5000 + b"]" * 5000,
        b'{"model": "hf-served", "prompt": "' + b"y " * 5000 + b'"}',
        b"null",
        b"1e999",
        b'{"model": "hf-served", "prompt": "x", "max_tokens": 1e400}',
    ]
    requests += [("/v1/completions", body) for body in raw]
    while len(requests) < 320:  # random mixes of the above
        field, value = rng.choice(fields), rng.choice(weird)
        body = {"model": rng.choice(["hf-served", "other", 7]), "prompt": rng.choice(["", 3, ["a", "b"], {"x": 1}])}
        requests.append(("/v1/completions", json.dumps({**body, field: value}).encode()))
    return requests


def test_fuzzed_requests_never_fail_or_hang_the_server(server, client):
    import random
    import re

    reference = dict(model="hf-served", prompt="import os\n", max_tokens=12, temperature=0)
    before_text = client.completions.create(**reference).choices[0].text

    def counts() -> dict[str, float]:
        """Requests counted per status, over every path."""
        total: dict[str, float] = {}
        for status, n in re.findall(
            r'meshtrain_requests_total\{path="/v1[^"]*",status="(\d+)"\} (\S+)', httpx.get(server + "/metrics").text
        ):
            total[status] = total.get(status, 0) + float(n)
        return total

    start = counts()
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    seen: dict[str, int] = {}
    with httpx.Client(base_url=server, timeout=30) as http:  # a hang fails on the timeout
        for path, body in hostile_requests(random.Random(0)):
            response = http.post(path, content=body, headers=auth)
            assert response.status_code < 500, (body[:200], response.text[:500])
            assert response.status_code in (200, 400, 404, 422), (body[:200], response.text[:300])
            if response.status_code != 200:
                assert response.json()["error"]["message"]
            seen[str(response.status_code)] = seen.get(str(response.status_code), 0) + 1
    assert sum(seen.values()) >= 300 and seen.get("400") and seen.get("422")
    end = counts()
    for status, n in seen.items():  # every answer counted, with its status
        assert end.get(status, 0) - start.get(status, 0) == n, (status, n, start, end)
    assert httpx.get(server + "/health").json()["status"] == "ok"
    assert client.completions.create(**reference).choices[0].text == before_text


MC_TASK = """\
task: meshtrain_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
MC_ROWS = [
    {"question": "def add(a, b):\n    return a", "choices": [" + b", " - b", " * b"], "answer": 0},
    {"question": "import", "choices": [" os", " the", " 123"], "answer": 0},
    {"question": "for i in range(", "choices": ["10):", "x]", " while"], "answer": 0},
    {"question": "class Foo", "choices": ["(object):", " = 3", ";;"], "answer": 0},
]


def test_lm_evaluation_harness_scores_a_task_through_the_server(server, exported, cli_env, tmp_path):
    """lm-evaluation-harness's OpenAI-compatible completions model scores a local multiple-choice task
    against `meshtrain serve` (echo + logprobs over token-id prompts); its log-likelihoods equal
    transformers' on the exported model. Offline: the task and its data are files here."""
    from transformers import AutoTokenizer

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in MC_ROWS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "meshtrain_local_mc.yaml").write_text(MC_TASK.format(data=data))
    env = {
        **cli_env,
        "OPENAI_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    model_args = (
        f"model=hf-served,base_url={server}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={exported},num_concurrent=1,max_retries=1"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "meshtrain_local_mc",
            "--include_path",
            str(tasks),
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    samples = [
        json.loads(line)
        for f in (tmp_path / "out").rglob("samples_meshtrain_local_mc_*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(samples) == len(MC_ROWS)

    tok = AutoTokenizer.from_pretrained(exported)
    scored = 0
    for sample in samples:
        for pair, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation, logprob = pair["arg_0"], pair["arg_1"], float(response[0][0])
            spaces = len(context) - len(context.rstrip())  # lm-evaluation-harness's split of the pair
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            n_context = len(tok(context, add_special_tokens=False)["input_ids"])
            logprobs = hf_logprobs(exported, whole)
            expected = sum(logprobs[i - 1, whole[i]].item() for i in range(n_context, len(whole)))
            assert abs(logprob - expected) <= 1e-3, (context, continuation, logprob, expected)
            scored += 1
    assert scored == sum(len(row["choices"]) for row in MC_ROWS)


def test_generation_config_sets_the_sampling_a_request_leaves_out(tmp_path):
    """generation_config.json's temperature, top_p and top_k are the defaults of a request that
    leaves them out (what the model's authors sample with, as vLLM takes them); a request's own
    values win; a sampling value the server does not apply is named at load; a bad one is refused."""
    from types import SimpleNamespace

    from meshtrain.serve.app import _check
    from meshtrain.serve.loading import sampling_defaults
    from meshtrain.serve.requests import CompletionRequest

    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05, "eos_token_id": 2}
            | {"num_beams": 1, "num_beams_unused": 0, "min_new_tokens": 5}  # beams 1: as served; a key unknown here
        )
    )
    defaults, ignored = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9} and ignored == [
        "repetition_penalty = 1.05",
        "num_beams_unused = 0",
        "min_new_tokens = 5",
    ]
    tokenizer = SimpleNamespace(get_added_tokens_decoder=dict)  # no special tokens
    served = ServedModel("m", None, tokenizer, [], None, "", defaults)
    engine = SimpleNamespace(max_context=64, max_batch=1)
    left_out = _check(served, engine, CompletionRequest(model="m", prompt="x"), [1, 2], chat=False)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 0)
    given = CompletionRequest(model="m", prompt="x", temperature=0.5, top_p=1, top_k=3)
    assert (lambda p: (p.temperature, p.top_p, p.top_k))(_check(served, engine, given, [1, 2], chat=False)) == (
        0.5,
        1,
        3,
    )
    plain = _check(
        ServedModel("m", None, tokenizer, [], None, ""), engine, CompletionRequest(model="m", prompt="x"), [1], False
    )
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, 16)  # OpenAI's defaults
    # max_new_tokens: the default length of a request (vLLM's reading), up to the context's room
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    lengthy = ServedModel("m", None, tokenizer, [], None, "", sampling_defaults(tmp_path)[0])
    assert _check(lengthy, engine, CompletionRequest(model="m", prompt="x"), [1, 2], chat=False).max_tokens == 40
    assert _check(lengthy, engine, CompletionRequest(model="m", prompt="x"), [1] * 60, chat=False).max_tokens == 4
    given = CompletionRequest(model="m", prompt="x", max_tokens=3)
    assert _check(lengthy, engine, given, [1, 2], chat=False).max_tokens == 3
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(MeshtrainError, match="max_new_tokens = 0: input should be greater than or equal to 1"):
        sampling_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(MeshtrainError, match="temperature = -1: input should be greater than or equal to 0"):
        sampling_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": True}))
    with pytest.raises(MeshtrainError, match="top_p = True: input should be a valid number"):
        sampling_defaults(tmp_path)
    # do_sample false: greedy by default, as transformers decodes it (meshtrain's own export writes it)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 40})
    )
    greedy = ServedModel("m", None, tokenizer, [], None, "", sampling_defaults(tmp_path)[0])
    left_out = _check(greedy, engine, CompletionRequest(model="m", prompt="x"), [1, 2], chat=False)
    assert (left_out.temperature, left_out.max_tokens) == (0.0, 40)
    given = CompletionRequest(model="m", prompt="x", temperature=0.7)
    assert _check(greedy, engine, given, [1, 2], chat=False).temperature == 0.7
    with pytest.raises(APIError, match="top_p shapes sampling, but this model decodes greedily"):
        _check(greedy, engine, CompletionRequest(model="m", prompt="x", top_p=0.5), [1, 2], chat=False)
    with pytest.raises(APIError, match="seed shapes sampling, but this model decodes greedily"):
        _check(greedy, engine, CompletionRequest(model="m", prompt="x", seed=3), [1, 2], chat=False)
    seeded = CompletionRequest(model="m", prompt="x", temperature=0.0, seed=3)  # as lm-eval sends it
    assert _check(greedy, engine, seeded, [1, 2], chat=False).temperature == 0.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": "no"}))
    with pytest.raises(MeshtrainError, match="do_sample = 'no': it should be true or false"):
        sampling_defaults(tmp_path)


def tiny_run(directory, generation_config: dict | None = None):
    """A run directory as training leaves it (model.safetensors, model.json, tokenizer.json) of a
    one-layer model, made in-process in a second; `generation_config`: a generation_config.json beside."""
    from meshtrain.data.tokenizer import train_bpe
    from meshtrain.interop.weights import save_model

    directory.mkdir()
    tokenizer = train_bpe(PROMPTS * 8, 300)
    tokenizer.save(str(directory / "tokenizer.json"))
    args = ModelArgs(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=tokenizer.get_vocab_size(), max_seq_len=512
    )
    model = Llama(args)
    model.init_weights(0)
    save_model(model.state_dict(), args, directory)
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory, args


def test_a_greedy_generation_config_keeps_its_top_p_and_top_k_for_requests_that_sample(tmp_path, monkeypatch, capsys):
    """`do_sample: false` makes greedy the default, but a request (or `generate`) that samples with a
    temperature gets the model's top_p and top_k, as transformers and vLLM keep them, not OpenAI's 1
    and off; the refusal of top_p/top_k under the greedy default concerns the request's own values."""
    from types import SimpleNamespace

    import meshtrain.serve as serve
    from meshtrain.serve.app import _check
    from meshtrain.serve.loading import load_served_model, sampling_defaults
    from meshtrain.serve.requests import CompletionRequest

    config = {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    run, _ = tiny_run(tmp_path / "run", config)
    assert sampling_defaults(run)[0] == {"temperature": 0.0, "top_p": 0.9, "top_k": 20}
    served = load_served_model(run, torch.device("cpu"), torch.float32)
    name, engine = served.name, SimpleNamespace(max_context=64, max_batch=1)

    def params(**fields) -> tuple:
        p = _check(served, engine, CompletionRequest(model=name, prompt="x", **fields), [1, 2], chat=False)
        return p.temperature, p.top_p, p.top_k

    assert params(temperature=0.7) == (0.7, 0.9, 20)  # the model's truncation, not OpenAI's (1, off)
    assert params(temperature=0.7, top_p=0.5, top_k=3) == (0.7, 0.5, 3)
    assert params()[0] == 0.0  # greedy by default; the model's own top_p/top_k are no reason to refuse
    with pytest.raises(APIError, match="top_k shapes sampling, but this model decodes greedily"):
        params(top_k=5)

    # `meshtrain generate`: the same defaults, read by the same rules (the engine records what it is given)
    given = []

    class Recording:
        def __init__(self, *args):
            pass

        def submit(self, request: Request) -> None:
            given.append(request.params)
            request.emit(("done", "length"))

        def close(self) -> None:
            pass

    monkeypatch.setattr(serve, "Engine", Recording)
    none = {"temperature": None, "top_p": None, "top_k": None}
    assert serve.generate_to_terminal(str(run), "def ", 4, none | {"temperature": 0.7}, None, "cpu") == 0
    assert (given[-1].temperature, given[-1].top_p, given[-1].top_k) == (0.7, 0.9, 20)
    capsys.readouterr()
    assert serve.generate_to_terminal(str(run), "def ", None, none, None, "cpu") == 0
    assert given[-1].temperature == 0.0
    assert "top_p" not in capsys.readouterr().err  # named as the model's only where they shape the output
    (run / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_length": 6}))
    assert serve.generate_to_terminal(str(run), "def ", None, none, None, "cpu") == 0
    prompt = len(load_served_model(run, torch.device("cpu"), torch.float32).prompt_ids("def ", chat=False))
    assert given[-1].max_tokens == max(1, 6 - prompt)  # max_length caps generate's default as serve's
    # greedy leaves top_p and top_k unused: out of range there, they are named and dropped, not refused
    (run / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_p": 0, "top_k": 50.0}))
    defaults, notes = sampling_defaults(run)
    assert defaults == {"temperature": 0.0} and [n.split(" = ")[0] for n in notes] == ["top_p", "top_k"]
    with pytest.raises(MeshtrainError, match="--top-k shapes sampling, but the model's generation_config.json"):
        serve.generate_to_terminal(str(run), "def ", 4, none | {"top_k": 5}, None, "cpu")
    capsys.readouterr()


def test_generation_config_values_the_server_does_not_apply_are_named_and_max_length_caps_the_default(tmp_path, capsys):
    """Every generation_config.json value that would change the tokens but that serving does not
    apply is named in a warning at load (not only repetition_penalty and min_p); token ids and other
    bookkeeping, and values at transformers' neutral default, are not. max_length (Llama 2 ships 4096)
    caps prompt + completion of a request that gives no max_tokens; a request's own max_tokens is
    kept (OpenAI's semantics), and max_new_tokens, where set, wins over it (transformers')."""
    from types import SimpleNamespace

    from meshtrain.serve.app import _check
    from meshtrain.serve.loading import load_served_model, sampling_defaults
    from meshtrain.serve.requests import ChatRequest, CompletionRequest

    unapplied = {
        "forced_eos_token_id": 2,
        "sequence_bias": [[[5], -1.0]],
        "exponential_decay_length_penalty": [10, 1.5],
        "penalty_alpha": 0.6,
        "dola_layers": "high",
        "guidance_scale": 1.5,
        "max_time": 10.0,
        "watermarking_config": {"greenlist_ratio": 0.25},
    }
    bookkeeping = {"bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0, "transformers_version": "4.45.0"}
    bookkeeping |= {
        "_from_model_config": True,
        "use_cache": True,
        "output_scores": False,
        "return_dict_in_generate": True,
    }
    neutral = {"repetition_penalty": 1.0, "num_beams": 1, "early_stopping": False, "suppress_tokens": [], "top_h": None}
    run, _ = tiny_run(tmp_path / "run", {"do_sample": True, "max_length": 50} | unapplied | bookkeeping | neutral)
    served = load_served_model(run, torch.device("cpu"), torch.float32)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert [w.split(" sets ")[1].split(" = ")[0] for w in warnings] == list(unapplied)
    assert all(w.endswith("which serving does not apply") for w in warnings)
    assert "exponential_decay_length_penalty = [10, 1.5], which" in warnings[2]
    assert served.sampling_defaults == {"max_length": 50}

    engine = SimpleNamespace(max_context=64, max_batch=1)

    def length(prompt: int, chat: bool = False, **fields) -> int:
        request = (
            ChatRequest(model=served.name, messages=[Message(role="user", content="x")], **fields)
            if chat
            else CompletionRequest(model=served.name, prompt="x", **fields)
        )
        return _check(served, engine, request, [1] * prompt, chat).max_tokens

    assert length(10) == 16 and length(40) == 10 and length(50) == 1  # OpenAI's 16, up to max_length in all
    assert length(10, chat=True) == 40  # chat: to max_length, not to the end of the 64-token context
    assert length(40, max_tokens=20) == 20  # the request's own length is kept past max_length
    with pytest.raises(APIError, match="maximum context length is 64 tokens"):
        length(40, max_tokens=30)  # ... not past the context
    (run / "generation_config.json").write_text(json.dumps({"max_length": 20, "max_new_tokens": 30}))
    served.sampling_defaults = sampling_defaults(run)[0]
    assert length(10) == 30  # max_new_tokens wins, as transformers reads the two
    (run / "generation_config.json").write_text(json.dumps({"max_length": 0}))
    with pytest.raises(MeshtrainError, match="max_length = 0: input should be greater than or equal to 1"):
        sampling_defaults(run)


def test_a_bf16_served_model_keeps_fp32_rotary_tables(tmp_path):
    """Loading in bf16 casts every float buffer; the rotary cos/sin tables are put back in fp32,
    equal to those training computes (bf16 ones rotate by other angles, which `.float()` cannot undo)."""
    from meshtrain.serve.loading import load_served_model

    run, args = tiny_run(tmp_path / "run")
    model = load_served_model(run, torch.device("cpu"), torch.bfloat16).model
    fresh = Llama(args)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert torch.equal(model.rope_cos, fresh.rope_cos) and torch.equal(model.rope_sin, fresh.rope_sin)


def test_auto_dtype_keeps_a_hugging_face_models_fp16_on_a_gpu(tmp_path):
    """--dtype auto on a GPU serves an fp16 checkpoint in fp16 (bf16 would drop three bits of every
    weight), anything else in bf16; on a CPU fp32. fp16 can be asked for by name."""
    from meshtrain.serve import _load, auto_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # the choice only: nothing is put on the GPU
    for key, stored, chosen in (
        ("torch_dtype", "float16", torch.float16),
        ("dtype", "float16", torch.float16),
        ("dtype", "bfloat16", torch.bfloat16),
        ("torch_dtype", "float32", torch.bfloat16),
    ):
        (tmp_path / "config.json").write_text(json.dumps({key: stored}))
        assert auto_dtype(tmp_path, cuda) == chosen and auto_dtype(tmp_path, cpu) == torch.float32
    assert auto_dtype(tmp_path / "a-run-dir", cuda) == torch.bfloat16  # meshtrain's own: trained in fp32/bf16
    run, _ = tiny_run(tmp_path / "run")
    assert _load(str(run), "cpu", "fp16").model.tok_embeddings.weight.dtype == torch.float16
    with pytest.raises(MeshtrainError, match="--dtype fp8 is unknown: use auto, fp32, bf16 or fp16"):
        _load(str(run), "cpu", "fp8")


def test_logprobs_give_each_tokens_own_bytes_and_the_likelier_of_two_alike(corpus):
    """OpenAI's `bytes` rebuild a character split over tokens: each piece's own byte (decoded alone
    it reads U+FFFD), for a byte-level BPE and for SentencePiece's byte fallback; in the legacy
    {text: logprob} dict, two tokens that read alike keep the likelier one's logprob."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models

    from meshtrain.data.tokenizer import token_bytes
    from meshtrain.serve.app import _top_by_text

    bpe = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    ids = bpe.encode("café 日本 <|endoftext|>").ids
    assert b"".join(token_bytes(bpe, i) for i in ids) == "café 日本 <|endoftext|>".encode()
    pieces = [i for i in ids if bpe.decode([i]) == "\ufffd"]
    assert len(pieces) >= 2 and all(len(token_bytes(bpe, i)) == 1 for i in pieces)
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "▁caf": 3}
    fallback = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert [token_bytes(fallback, i) for i in (3, 1, 2)] == [b" caf", b"\xc3", b"\xa9"]
    served = SimpleNamespace(tokenizer=bpe)
    first, second = pieces[:2]
    assert _top_by_text(served, {first: -0.5, second: -3.0}) == {"\ufffd": -0.5}
