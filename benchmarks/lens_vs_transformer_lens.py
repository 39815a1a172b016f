"""qkv.lens beside TransformerLens on the same model, the same token ids and the same machine.

TransformerLens is not a dependency of qkv; run this with a Python where it is installed beside
qkv, for example a virtual environment that sees qkv's packages:

    python -m venv --system-site-packages /tmp/tlenv
    /tmp/tlenv/bin/pip install -c <(echo torch==2.13.0) transformer-lens
    HF_HUB_OFFLINE=1 /tmp/tlenv/bin/python benchmarks/lens_vs_transformer_lens.py            # SmolLM2
    HF_HUB_OFFLINE=1 /tmp/tlenv/bin/python benchmarks/lens_vs_transformer_lens.py --model tiny-gpt2

TransformerLens (4.x) wraps transformers' own model (``TransformerBridge.boot_transformers``, its
compatibility mode for the classic hook names); SmolLM2 is transformers' reading of the bundled
GGUF file, de-quantised to float32, as qkv reads it. Both run float32 on the same ids.

Each task is done the way each library's documentation does it, timed round-robin (qkv, then
TransformerLens, ``--repeat`` times; the medians reported), and the answers are compared:
- ``cache``: run_with_cache of everything;
- ``logit_lens``: every layer's log-probabilities at every position. TransformerLens:
  ``cache.accumulated_resid(apply_ln=True)`` through the unembedding (its documented recipe) and,
  separately, each row through ``ln_final`` recomputed (what qkv does); the first reuses the final
  layer's cached norm scale for every row (TransformerLens #1076), so its rows other than the last
  are not what the model would predict there;
- ``effects``: every head zeroed in turn (its ``hook_z`` slice), the loss over the text;
  TransformerLens: one hooked forward pass per head;
- ``patch_head``: each head's output patched from the clean run into the corrupt one, normalised
  logit difference; TransformerLens: ``patching.get_act_patch_attn_head_out_all_pos``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

TEXT = ("The quick brown fox jumps over the lazy dog. When Mary and John went to the store, John gave a "
        "drink to Mary because she was thirsty after the long walk home from the old market square and")


def tiny_gpt2(folder: Path):
    """A 2-layer x 4-head GPT-2 (vocabulary of 96 words "w0".."w95", seed 0) saved with a
    tokenizer, as tests/helpers.py builds them; returns the folder."""
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(folder)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def main() -> None:
    import _common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny-gpt2"))
    p.add_argument("--tokens", type=int, default=64, help="length of the text in tokens")
    p.add_argument("--repeat", type=int, default=3, help="round-robin rounds (medians reported)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/"
                   "lens_vs_transformer_lens[_tiny_gpt2].json)")
    args = p.parse_args()

    try:
        import transformer_lens as tl
        import transformer_lens.patching as tl_patching
    except ImportError:
        sys.exit("transformer_lens is not installed here: the top of this file says how to run it beside qkv")
    import torch
    import transformers

    import qkv
    from qkv import lens

    machine = C.machine_info()
    print(C.machine_line(machine))
    tmp = tempfile.TemporaryDirectory()
    if args.model == "smollm2":
        from qkv.inference.resolve import resolve

        path = resolve("smollm2").path
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        lm = qkv.load("smollm2", weights="fp32")
        hub_name = "HuggingFaceTB/SmolLM2-135M-Instruct"  # names the architecture only: nothing fetched
        ids = lm.tokenizer.encode(TEXT)
    else:
        folder = tiny_gpt2(Path(tmp.name))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        lm = qkv.load(str(folder))
        hub_name = "gpt2"
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 96, (args.tokens,), generator=g).tolist()
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = ids[: args.tokens]
    corrupt = [*ids[:-3], ids[-2], ids[-3], ids[-1]]  # two tokens swapped near the end

    bridge = tl.TransformerBridge.boot_transformers(hub_name, hf_model=hf, tokenizer=tok)
    bridge.enable_compatibility_mode()
    bridge.eval()
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    toks = torch.tensor([ids])
    ctoks = torch.tensor([corrupt])

    # --- the tasks, each library its own way ---------------------------------------------------
    def tl_cache():
        return bridge.run_with_cache(toks)

    def tl_lens_documented():
        _, cache = bridge.run_with_cache(toks)
        stack = cache.accumulated_resid(apply_ln=True)  # (L + 1, 1, T, d)
        return torch.log_softmax(stack[:, 0] @ bridge.W_U + bridge.b_U, -1)

    def tl_lens_recomputed():
        _, cache = bridge.run_with_cache(toks)
        stack = cache.accumulated_resid(apply_ln=False)
        return torch.log_softmax(bridge.ln_final(stack[:, 0]) @ bridge.W_U + bridge.b_U, -1)

    def tl_effects():
        out = torch.empty(L, H)
        for layer in range(L):
            for head in range(H):
                def zero(z, hook, head=head):
                    z[:, :, head] = 0.0
                    return z
                out[layer, head] = bridge.run_with_hooks(
                    toks, return_type="loss", fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero)]).item()
        return out

    with torch.inference_mode():
        clean_logits, clean_cache = bridge.run_with_cache(toks)
        corrupt_logits = bridge(ctoks)
    a, b = int(clean_logits[0, -1].argmax()), int(corrupt_logits[0, -1].argmax())
    if a == b:
        b = int(clean_logits[0, -1].topk(2).indices[1])
    ld_c = float(clean_logits[0, -1, a] - clean_logits[0, -1, b])
    ld_k = float(corrupt_logits[0, -1, a] - corrupt_logits[0, -1, b])

    def tl_patch():
        def metric(logits):
            return ((logits[0, -1, a] - logits[0, -1, b]) - ld_k) / (ld_c - ld_k)
        return tl_patching.get_act_patch_attn_head_out_all_pos(bridge, ctoks, clean_cache, metric)

    tasks = {
        "cache": (lambda: lens.run_with_cache(lm, ids), tl_cache),
        "logit_lens": (lambda: lens.logit_lens(lm, ids).logprobs, tl_lens_recomputed),
        "effects": (lambda: lens.head_effects(lm, ids).values, tl_effects),
        "patch_head": (lambda: lens.patch(lm, ids, corrupt, site="head", answer=a, wrong=b).values, tl_patch),
    }
    seconds: dict[str, dict[str, list[float]]] = {k: {"qkv": [], "transformer_lens": []} for k in tasks}
    answers: dict[str, dict[str, object]] = {k: {} for k in tasks}
    meter = C.LoadMeter()
    with torch.inference_mode():
        for name, pair in tasks.items():
            for fn in pair:  # warm-up, and the answers to compare
                answers[name][fn] = fn()
            for _ in range(args.repeat):
                for who, fn in zip(("qkv", "transformer_lens"), pair, strict=True):
                    t0 = time.perf_counter()
                    fn()
                    seconds[name][who].append(time.perf_counter() - t0)
            q, t = C.median(seconds[name]["qkv"]), C.median(seconds[name]["transformer_lens"])
            print(f"{name}: qkv {q:.3f} s, TransformerLens {t:.3f} s ({t / q:.1f}x)", flush=True)
        documented = tl_lens_documented()
    load = meter.stop()

    # --- do they agree? -------------------------------------------------------------------------
    def ans(name, i):
        return list(answers[name].values())[i]

    q_lens, t_lens = ans("logit_lens", 0).float(), ans("logit_lens", 1).float()
    q_last = ans("cache", 0).logits.float().reshape(len(ids), -1)[-1].softmax(-1)

    def gap(name: str) -> float:
        return float((ans(name, 0).float() - ans(name, 1).float()).abs().max())

    model_logprobs = torch.log_softmax(clean_logits[0].float(), -1)
    agree = {
        "next_token_max_abs_prob_diff": float((q_last - clean_logits[0, -1].softmax(-1)).abs().max()),
        "logit_lens_max_abs_logprob_diff": float((q_lens - t_lens).abs().max()),
        "logit_lens_last_row_vs_model": float((q_lens[-1] - model_logprobs).abs().max()),
        "tl_documented_lens_max_abs_diff_from_recomputed": float((documented - t_lens).abs().max()),
        "tl_documented_lens_top1_agreement_with_recomputed": float(
            (documented[:-1].argmax(-1) == t_lens[:-1].argmax(-1)).float().mean()),
        "effects_max_abs_loss_diff": gap("effects"),
        "patch_head_max_abs_diff": gap("patch_head"),
    }
    for k, v in agree.items():
        print(f"{k}: {v:.3g}")
    rows = [[n, f"{C.median(s['qkv']):.3f}", f"{C.median(s['transformer_lens']):.3f}",
             f"{C.median(s['transformer_lens']) / C.median(s['qkv']):.1f}x"] for n, s in seconds.items()]
    C.print_table(f"qkv.lens vs TransformerLens {tl.__version__ if hasattr(tl, '__version__') else ''} on "
                  f"{args.model} ({L} layers x {H} heads), {len(ids)} tokens, float32 ({C.load_line(load)})",
                  ["task", "qkv s", "TransformerLens s", "TL / qkv"], rows)
    from importlib.metadata import version

    name = "lens_vs_transformer_lens" + ("" if args.model == "smollm2" else "_tiny_gpt2")
    out = C.write_json(name, {
        "machine": machine, "load": load, "model": args.model, "tokens": len(ids), "repeat": args.repeat,
        "transformer_lens": version("transformer-lens"), "transformers": version("transformers"),
        "seconds": {n: {w: [round(x, 4) for x in v] for w, v in s.items()} for n, s in seconds.items()},
        "agreement": agree}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
