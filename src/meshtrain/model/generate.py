"""Sampling from a trained model (full recompute per token: for short demos and tests)."""

from __future__ import annotations

import torch

from meshtrain.model.llama import Llama


@torch.no_grad()
def generate(model: Llama, prompt: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0, stop_token: int | None = None) -> list[int]:
    """Append up to max_new_tokens; temperature 0 is greedy."""
    model.eval()
    device = model.rope_cos.device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(max_new_tokens):
        context = tokens[:, -model.args.max_seq_len :]
        logits = model(context)[0, -1, : model.args.vocab_size].float()  # no padding rows
        if temperature <= 0:
            nxt = logits.argmax()
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[0]
        if stop_token is not None and nxt.item() == stop_token:
            break
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return tokens[0, len(prompt) :].tolist()


def sample_text(state: dict[str, torch.Tensor], args, tokenizer_path, prompt: str, max_new_tokens: int,
                eos_id: int | None) -> str:
    """The end-of-run demo: the prompt and a sampled continuation, from the full weights."""
    from tokenizers import Tokenizer

    model = Llama(args)
    model.load_state_dict(state, strict=False)
    tok = Tokenizer.from_file(str(tokenizer_path))
    return prompt + tok.decode(generate(model, tok.encode(prompt).ids, max_new_tokens, stop_token=eos_id))
