"""The baseline server for `bench serve`: transformers' generate() behind the same OpenAI streaming
endpoint, one request at a time (what a user gets by wrapping a Hugging Face model in a web app).
python -m bench.hf_server HF_DIR --port P"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def create_app(directory: str) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    app, lock = FastAPI(), asyncio.Lock()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)

        def run():
            with torch.no_grad():
                out = model.generate(
                    ids,
                    max_new_tokens=body.get("max_tokens", 16),
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=tokenizer.eos_token_id,
                )
            run.tokens = out.shape[1] - ids.shape[1]

        async def stream():
            async with lock:  # one generation at a time
                worker = threading.Thread(target=run)
                worker.start()
                iterator = iter(streamer)
                while (text := await asyncio.to_thread(next, iterator, None)) is not None:
                    if text:
                        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"
                await asyncio.to_thread(worker.join)
                usage = {"completion_tokens": run.tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    uvicorn.run(create_app(a.directory), host="127.0.0.1", port=a.port, log_level="warning")
