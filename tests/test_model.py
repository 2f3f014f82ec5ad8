import dataclasses
import math

import pytest
import torch

from meshtrain.model import PRESETS, Llama, ModelArgs, num_params
from meshtrain.model.llama import apply_rope, precompute_rope
from meshtrain.model.shapes import Shape

ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=32)


def make(args=ARGS, seed=0):
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.mark.parametrize(
    "name, low, high",
    [
        ("tiny", 5e6, 10e6),
        ("small", 45e6, 55e6),
        ("gpt2-124m", 120e6, 128e6),
        ("gpt2-345m", 340e6, 370e6),
        ("llama3-8b", 8.00e9, 8.06e9),
        ("llama3-70b", 70.4e9, 70.7e9),
        ("llama3-405b", 405e9, 406.5e9),
        # the published models' parameter counts (their model cards and safetensors indexes)
        ("llama3.1-8b", 8.02e9, 8.04e9),
        ("llama3.1-70b", 70.5e9, 70.6e9),
        ("llama3.1-405b", 405.8e9, 406.0e9),
        ("llama3.2-1b", 1.23e9, 1.24e9),
        ("llama3.2-3b", 3.21e9, 3.22e9),
        ("mistral-7b", 7.24e9, 7.25e9),
        ("qwen2.5-7b", 7.61e9, 7.62e9),
        ("qwen2.5-72b", 72.7e9, 72.8e9),
        ("qwen3-8b", 8.19e9, 8.20e9),
        ("qwen3-32b", 32.7e9, 32.8e9),
    ],
)
def test_preset_sizes(name, low, high):
    with torch.device("meta"):
        model = Llama(PRESETS[name])
    assert low <= num_params(model) <= high


def test_causal_future_tokens_do_not_change_past_logits():
    model = make()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % ARGS.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_init_is_seeded_and_independent_of_which_layers_a_rank_holds():
    full = make(seed=3)
    assert torch.equal(full.layers["2"].attention.wq.weight, make(seed=3).layers["2"].attention.wq.weight)
    assert not torch.equal(full.layers["2"].attention.wq.weight, make(seed=4).layers["2"].attention.wq.weight)
    # A pipeline stage that holds only layer 2 (as apply_pp builds it) gets the same values.
    with torch.device("meta"):
        stage = Llama(ARGS)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(3)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full.get_parameter(name)), name
    # norms start at one, residual projections smaller than the rest
    assert torch.equal(full.norm.weight, torch.ones(ARGS.dim))
    assert full.layers["0"].attention.wo.weight.std() < full.layers["0"].attention.wq.weight.std()


def test_tied_embeddings_share_one_tensor():
    model = make(dataclasses.replace(ARGS, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert num_params(model) == num_params(make()) - ARGS.padded_vocab_size * ARGS.dim


def test_saved_weights_load_whole_or_are_refused():
    """A run's full weights must hold every tensor of the model (a tied output aside, being the
    embedding): a missing layer would otherwise keep its random initial weights."""
    from meshtrain.errors import CheckpointError

    args = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    source, target = Llama(args), Llama(args)
    source.init_weights(1)
    target.init_weights(2)
    state = {k: v for k, v in source.state_dict().items() if k != "output.weight"}
    target.load_full_state(state)
    assert torch.equal(target.output.weight, source.tok_embeddings.weight)
    assert target.output.weight is target.tok_embeddings.weight
    for broken in (
        {k: v for k, v in state.items() if not k.startswith("layers.1.")},
        {**state, "extra": state["norm.weight"]},
    ):
        with pytest.raises(CheckpointError, match="the saved weights do not fit the model"):
            Llama(args).load_full_state(broken)


def test_rope_is_a_rotation_that_encodes_relative_position():
    cos, sin = precompute_rope(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=8, vocab_size=8), 32)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def rot(x, pos):
        return apply_rope(x.expand(1, 32, 1, 16), cos, sin)[:, pos]

    torch.testing.assert_close(rot(q, 5).norm(), q.norm())
    # <R_m q, R_n k> depends on m - n only
    torch.testing.assert_close((rot(q, 7) * rot(k, 3)).sum(), (rot(q, 14) * rot(k, 10)).sum(), rtol=1e-4, atol=1e-5)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    gqa = make()
    mha_args = dataclasses.replace(ARGS, n_kv_heads=ARGS.n_heads)
    mha = make(mha_args)
    mha.load_state_dict(
        {
            k: (
                v.view(ARGS.n_kv_heads, -1, ARGS.dim).repeat_interleave(2, 0).reshape(-1, ARGS.dim)
                if k.endswith(("wk.weight", "wv.weight"))
                else v
            )
            for k, v in gqa.state_dict().items()
        }
    )
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_flops_per_token_is_six_n_plus_attention():
    model = make()
    n = num_params(model, exclude_embedding=True)
    assert math.isclose(Shape.from_args(ARGS).flops_per_token(32), 6 * n + 12 * ARGS.n_layers * ARGS.dim * 32)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_planner_sees_every_parameter_the_model_has(preset):
    with torch.device("meta"):
        model = Llama(PRESETS[preset])
    seen = {id(p): (name, tuple(p.shape)) for name, p in model.named_parameters()}
    assert [(p.name, p.shape) for p in Shape.from_args(PRESETS[preset]).parameters()] == list(seen.values())


def test_model_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.arange(17).repeat(2, 1) % 7
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1
