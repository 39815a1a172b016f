"""The decoding loop: cached and uncached greedy decoding give identical tokens, inside the
context and far past it; every step's logits follow the documented context policy; prompt
cropping; seeded sampling is reproducible."""

from __future__ import annotations

import pytest
import torch

from qkv.generation import generate
from qkv.generation.decode import crop_prompt
from qkv.models.gpt import GPT, GPTConfig

V, W = 40, 8  # vocabulary, context (max_seq_len)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def model(positions: str = "learned", seed: int = 2, ctx: int = W) -> GPT:
    """A random GPT with large enough weights that greedy decoding does not just repeat one
    token (so the comparisons below see varied contexts)."""
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=V, max_seq_len=ctx, dim=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, positions=positions))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:  # matrices and tables; norm gains stay 1
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def prompt(B: int, T: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def run(m: GPT, x: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """(B, n) tokens from the generator."""
    return torch.stack(list(generate(m, x, n, **kw)), dim=1)


def window_starts(prompt_len: int, n_steps: int, ctx: int) -> list[int]:
    """The documented context policy, written out: the model sees tokens[start:L]. ``start``
    stays put until the context L - start would exceed ``ctx``; then it moves to keep the
    newest ctx // 2 tokens. Returns ``start`` for each of the n_steps decoding steps."""
    L = min(prompt_len, max(1, ctx - 1))  # the prompt is first cropped to ctx - 1
    starts, start = [], 0
    for _ in range(n_steps):
        if L - start > ctx:
            start = L - ctx // 2
        starts.append(start)
        L += 1
    return starts


def test_window_starts_by_hand() -> None:
    # ctx 8, prompt 3: lengths 3..8 fit (start 0); at L = 9 keep the newest 4 (start 5); the
    # context then grows 4..8 over L = 9..13; at L = 14 start jumps to 10; and so on.
    assert window_starts(3, 16, 8) == [0] * 6 + [5] * 5 + [10] * 5
    assert window_starts(20, 3, 8) == [0, 0, 5]  # prompt cropped to 7 tokens, then 8, then 9
    assert window_starts(1, 4, 3) == [0, 0, 0, 3]  # ctx 3: only the newest token remains at L = 4


# --------------------------------------------------------------------------- cache = no cache


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("n_new", [5, 45])  # within the context; several times past it
def test_greedy_cache_equals_no_cache(positions: str, n_new: int) -> None:
    m = model(positions)
    x = prompt(3, 3)
    cached = run(m, x, n_new, temperature=0.0)
    uncached = run(m, x, n_new, temperature=0.0, use_cache=False)
    assert cached.shape == (3, n_new)
    assert torch.equal(cached, uncached)
    # Varied tokens in every row, so the comparison is not vacuous.
    assert all(len(set(row.tolist())) >= min(6, n_new - 3) for row in cached)
    assert not torch.equal(cached[0], cached[1])  # and the rows differ


class Recorder:
    """A forward hook that keeps every (input ids, logits) the model is called with."""

    def __init__(self, m: GPT) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handle = m.register_forward_hook(self.hook)

    def hook(self, module, args, out) -> None:
        self.calls.append((args[0].clone(), out.logits[:, -1].clone()))


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_every_step_follows_the_context_policy(positions: str, use_cache: bool) -> None:
    m = model(positions)
    x = prompt(2, 3)
    n = 3 * W + 5
    rec = Recorder(m)
    out = run(m, x, n, temperature=0.0, use_cache=use_cache)
    rec.handle.remove()
    seq = torch.cat([x, out], dim=1)  # every token, prompt first
    starts = window_starts(3, n, W)
    assert len(rec.calls) == n
    for step, ((ids, logits), start) in enumerate(zip(rec.calls, starts, strict=True)):
        L = 3 + step
        context = seq[:, start:L]
        if not use_cache:
            assert torch.equal(ids, context), step  # exactly the window, nothing more
        # Independent: a fresh full forward over the window, no cache, all positions.
        with torch.no_grad():
            expected = m(context).logits[:, -1]
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        assert torch.equal(out[:, step], expected.argmax(-1)), step


def test_cached_path_rebuilds_the_cache_at_each_jump() -> None:
    m = model("rope")
    x = prompt(1, 3)
    rec = Recorder(m)
    run(m, x, 2 * W, temperature=0.0)
    rec.handle.remove()
    fed = [ids.shape[1] for ids, _ in rec.calls]
    # The prefill of 3, one token per step, and one prefill of W // 2 when the window jumps.
    starts = window_starts(3, 2 * W, W)
    jumps = {i for i in range(1, len(starts)) if starts[i] != starts[i - 1]}
    assert fed == [3] + [W // 2 if i in jumps else 1 for i in range(1, 2 * W)]


# --------------------------------------------------------------------------- prompts


def test_crop_prompt() -> None:
    ids = torch.arange(20).view(1, 20)
    cropped, was = crop_prompt(ids, 8)
    assert was and cropped.tolist() == [list(range(13, 20))]  # the last max_seq_len - 1
    same, was = crop_prompt(ids[:, :7], 8)
    assert not was and same.tolist() == [list(range(7))]
    one, was = crop_prompt(ids, 1)
    assert was and one.tolist() == [[19]]  # never an empty prompt


@pytest.mark.parametrize("use_cache", [True, False])
def test_long_prompt_is_cropped(use_cache: bool) -> None:
    m = model("learned")
    long = prompt(2, 3 * W)
    out = run(m, long, 6, temperature=0.0, use_cache=use_cache)
    expected = run(m, long[:, -(W - 1) :], 6, temperature=0.0, use_cache=use_cache)
    assert torch.equal(out, expected)


def test_bad_prompts() -> None:
    m = model()
    with pytest.raises(ValueError, match="prompt"):
        next(generate(m, torch.zeros(4, dtype=torch.long), 3))
    with pytest.raises(ValueError, match="prompt"):
        next(generate(m, torch.zeros(1, 0, dtype=torch.long), 3))
    assert list(generate(m, prompt(1, 2), 0)) == []


@pytest.mark.parametrize("use_cache", [True, False])
def test_context_of_one_token_is_a_bigram_model(use_cache: bool) -> None:
    """max_seq_len = 1 is a valid config (a bigram model): each step sees only the last token."""
    m = model("learned", ctx=1)
    x = prompt(2, 5)  # cropped to its last token
    out = run(m, x, 6, temperature=0.0, use_cache=use_cache)
    prev = x[:, -1]
    for step in range(6):
        with torch.no_grad():
            expected = m(prev[:, None]).logits[:, -1].argmax(-1)
        assert torch.equal(out[:, step], expected), step
        prev = out[:, step]


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("use_cache", [True, False])
def test_seeded_sampling_is_reproducible(use_cache: bool) -> None:
    m = model("rope")
    x = prompt(2, 4)
    kw = dict(temperature=1.0, top_k=20, top_p=0.95, use_cache=use_cache)

    def sample(seed: int) -> torch.Tensor:
        return run(m, x, 2 * W, generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_seeded_sampling_same_with_and_without_cache() -> None:
    m = model("learned")
    x = prompt(2, 4)
    out = [run(m, x, 2 * W, temperature=0.9, use_cache=c,
               generator=torch.Generator().manual_seed(5)) for c in (True, False)]
    assert torch.equal(out[0], out[1])


def test_negative_max_new_tokens_generates_nothing() -> None:
    from qkv.generation import generate
    from qkv.models.gpt import GPT, GPTConfig

    m = GPT(GPTConfig(vocab_size=11, max_seq_len=8, dim=8, n_layers=1, n_heads=2))
    for n in (-5, -1, 0):
        assert list(generate(m, torch.tensor([[1, 2, 3]]), n)) == []


@pytest.mark.parametrize("use_cache", [True, False])
def test_returned_weights_are_the_full_forward_passes_last_row(use_cache: bool) -> None:
    """return_weights: each step's (B, H, S) row per layer equals the last query's row of an
    uncached forward pass over everything before that step (within the context)."""
    m = model(ctx=16)
    x = prompt(2, 3)
    seen = x
    for nxt, weights in generate(m, x, 6, temperature=0.0, use_cache=use_cache, return_weights=True):
        with torch.no_grad():
            ref = m(seen, backend="reference", return_weights=True)
        assert torch.equal(nxt, ref.logits[:, -1].argmax(-1))
        assert len(weights) == m.cfg.n_layers
        for w, r in zip(weights, ref.weights, strict=True):
            torch.testing.assert_close(w, r[:, :, -1], rtol=1e-5, atol=1e-6)
        seen = torch.cat([seen, nxt[:, None]], 1)
    with pytest.raises(ValueError, match=r"torch\.compile step"):
        next(generate(m, x, 2, return_weights=True, mode="jit"))


def test_stop_ids_end_each_row_at_its_first_stop() -> None:
    m = model(ctx=64)
    x = prompt(2, 3)
    full = run(m, x, 20, temperature=0.0)  # (2, 20), no stops
    stop = int(full[0, 5])  # row 0 produces it at step 5 (or earlier)
    firsts = [next((i for i, t in enumerate(row.tolist()) if t == stop), None) for row in full]
    out = list(generate(m, x, 20, temperature=0.0, stop_ids=[stop]))
    ends = max(f if f is not None else 20 for f in firsts)
    assert len(out) == ends  # ends when the last row stops; that step is not yielded
    got = torch.stack(out, 1)
    for b, f in enumerate(firsts):
        if f is None:
            assert torch.equal(got[b], full[b, :ends])
        else:  # its tokens, then its stop id repeated
            assert got[b, :f].tolist() == full[b, :f].tolist() and set(got[b, f:].tolist()) <= {stop}
    assert list(generate(m, x[:1], 20, temperature=0.0, stop_ids=[int(full[0, 0])])) == []
    # one row (its own path): its tokens up to its first stop id, which is not yielded
    alone = run(m, x[:1], 20, temperature=0.0)[0].tolist()
    first = alone.index(stop) if stop in alone else 20
    out = [int(t[0]) for t in generate(m, x[:1], 20, temperature=0.0, stop_ids=[stop, 10**6])]
    assert out == alone[:first]


def test_seed_is_a_seeded_generator_and_leaves_the_global_rng_alone() -> None:
    from qkv.generation.sampling import make_generator

    m = model(ctx=64)
    x = prompt(1, 3)
    a = run(m, x, 12, temperature=1.0, seed=7)
    b = run(m, x, 12, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and not torch.equal(a, run(m, x, 12, temperature=1.0, seed=8))
    state = torch.get_rng_state()
    g1, g2 = make_generator("cpu"), make_generator("cpu")  # fresh entropy: two requests differ
    assert g1.initial_seed() != g2.initial_seed()
    assert make_generator("cpu", 5).initial_seed() == 5
    assert torch.equal(torch.get_rng_state(), state)
