"""Parity of the pretrained models: how far each of qkv's weight formats is from the reference.

Not a timing: every number here is a difference between two models' outputs on fixed inputs,
so it does not depend on how busy the machine is. What it records (the numbers BENCHMARKS.md
and README.md quote for agreement):

- SmolLM2-135M-Instruct, teacher-forced over ``--positions`` (default 1,000) tokens of held
  text (Python's own documentation, ``pydoc_data``, which nothing in qkv is tuned on): qkv fp32
  against ``transformers`` fp32 reading the same GGUF (max abs logit difference, top-1
  agreement), and qkv bf16 / int8 / q4 and ``transformers`` bf16 against their fp32 model
  (top-1 agreement, perplexity ratio, max abs logit difference).
- The chat prompts of the README and the tests: the first answer token's two best fp32 logits
  (the margin a format's rounding must not cross), each model's last-logit difference to fp32,
  and the greedy answer of every qkv format and of ``transformers`` fp32 / bf16.
- The same chat prompts in qkv bf16 once more in a child process limited to AVX2 kernels
  (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``: bf16 products emulated, as on a CPU
  without bf16 instructions), whose rounding differs from the native path.
- MiniLM: ``SentenceEncoder.embed`` against ``sentence-transformers`` ``encode`` on 1,000
  sentences of the same documentation (max abs difference of the unit vectors).

    python benchmarks/pretrained_parity.py           # ~2 minutes on 2 cores
    python benchmarks/pretrained_parity.py --quick   # 200 positions, 200 sentences
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import _common as C
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

NAME = "pretrained_parity"
FORMATS = ("bf16", "int8", "q4")
HELD_TOPICS = ("assert", "for", "while", "with", "if", "try", "function", "class", "import", "return")
# The README's example, whose first answer token is a near tie in fp32, and the phrasing the
# bf16 test uses because its margin is clear (tests/pretrained/test_smollm2.py).
CHAT_PROMPTS = ("What is the capital of France?", "What is the capital of France? Answer in one sentence.")
ANSWER_TOKENS = 20


def held_ids(tok, n: int) -> torch.Tensor:
    """(1, n + 1) tokens of Python's documentation: the first 300 are the tests' held text."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in HELD_TOPICS)
    ids = tok.encode(" ".join(text.split()))
    if len(ids) <= n:
        raise SystemExit(f"held text has only {len(ids)} tokens; ask for fewer --positions")
    return torch.tensor([ids[: n + 1]])


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits[0].float()


def _compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """Top-1 agreement, max abs logit difference and perplexities of ``got`` vs ``ref``."""
    ppl_ref = math.exp(F.cross_entropy(ref, targets).item())
    ppl = math.exp(F.cross_entropy(got, targets).item())
    return {"top1_agreement": round((ref.argmax(-1) == got.argmax(-1)).float().mean().item(), 4),
            "max_abs_logit_diff": round((got - ref).abs().max().item(), 6),
            "perplexity": round(ppl, 4), "perplexity_ref": round(ppl_ref, 4),
            "perplexity_change": round(ppl / ppl_ref - 1, 5)}


def _last_diff(model, ids: torch.Tensor, ref_last: torch.Tensor) -> float:
    return round((_logits(model, ids)[-1] - ref_last).abs().max().item(), 4)


def _hf_answer(model, tok, ids: torch.Tensor) -> str:
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=2)
    return tok.decode(out[0, ids.shape[1]:].tolist()).split("<|im_end|>")[0]


def smollm2_parity(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    import qkv
    from qkv.assets import asset_path

    path = asset_path("smollm2")
    lm = qkv.load("smollm2", weights="fp32")
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    formats = {w: copy.deepcopy(lm).quantize(w) for w in FORMATS}
    ids = held_ids(lm.tokenizer, args.positions)
    x, targets = ids[:, :-1], ids[0, 1:]
    base, hf_base = _logits(lm.model, x), _logits(ref, x)
    held: dict = {"qkv_fp32_vs_transformers_fp32": _compare(hf_base, base, targets),
                  "transformers_bf16_vs_transformers_fp32": _compare(hf_base, _logits(ref16, x), targets)}
    for w, q in formats.items():
        held[f"qkv_{w}_vs_qkv_fp32"] = _compare(base, _logits(q.model, x), targets)
    for k, v in held.items():
        print(f"held text, {k}: top-1 {v['top1_agreement']:.2%}, max |diff| "
              f"{v['max_abs_logit_diff']:.4f}, perplexity {v['perplexity_change']:+.2%}", flush=True)
    held.update(positions=args.positions, topics=list(HELD_TOPICS))

    chats = []
    for prompt in CHAT_PROMPTS:
        chat_ids = torch.tensor([lm.tokenizer.encode(lm.format_chat(prompt))])
        l32 = _logits(lm.model, chat_ids)[-1]
        top = torch.topk(l32, 2)
        first = [{"token": lm.tokenizer.decode([int(i)]), "logit": round(float(v), 3)}
                 for v, i in zip(top.values, top.indices, strict=True)]
        diffs = {"transformers fp32": _last_diff(ref, chat_ids, l32),
                 "transformers bf16": _last_diff(ref16, chat_ids, l32)}
        answers = {"qkv fp32": lm.generate(prompt, chat=True, max_new_tokens=ANSWER_TOKENS),
                   "transformers fp32": _hf_answer(ref, lm.tokenizer, chat_ids),
                   "transformers bf16": _hf_answer(ref16, lm.tokenizer, chat_ids)}
        for w, q in formats.items():
            diffs[f"qkv {w}"] = _last_diff(q.model, chat_ids, l32)
            answers[f"qkv {w}"] = q.generate(prompt, chat=True, max_new_tokens=ANSWER_TOKENS)
        for k, a in answers.items():
            print(f"{prompt!r}, {k}: {a!r}", flush=True)
        chats.append({"prompt": prompt, "fp32_first_answer_token": first,
                      "fp32_margin": round(float(top.values[0] - top.values[1]), 3),
                      "last_logits_vs_qkv_fp32": diffs, "answers": answers})
    return {"held_text": held, "chat": chats}


AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def bf16_chat() -> dict:
    """qkv bf16 on the chat prompts, in this process's kernels: each prompt's last-logit
    difference to qkv fp32 and the greedy answer."""
    import qkv

    lm = qkv.load("smollm2", weights="fp32")
    lm16 = copy.deepcopy(lm).quantize("bf16")
    out = {}
    for prompt in CHAT_PROMPTS:
        chat_ids = torch.tensor([lm.tokenizer.encode(lm.format_chat(prompt))])
        l32 = _logits(lm.model, chat_ids)[-1]
        out[prompt] = {"last_logits_vs_qkv_fp32": _last_diff(lm16.model, chat_ids, l32),
                       "answer": lm16.generate(prompt, chat=True, max_new_tokens=ANSWER_TOKENS)}
    return out


def bf16_chat_on_avx2_kernels() -> dict:
    """:func:`bf16_chat` in a child process limited to AVX2 kernels (no bf16 instructions:
    oneDNN and ATen then emulate bf16 products, as on an AVX2-only CPU). Rounding differs
    from the native avx512_bf16 path, and the README's near-tie prompt shows it."""
    import json
    import subprocess

    env = {**os.environ, **AVX2_ENV}
    out = subprocess.run([sys.executable, __file__, "--bf16-chat-probe"], capture_output=True, text=True,
                         env=env)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for prompt, r in res.items():
        print(f"{prompt!r}, qkv bf16 on AVX2 kernels: {r['answer']!r}", flush=True)
    return {"env": AVX2_ENV, "chat": res}


def minilm_parity(args: argparse.Namespace) -> dict:
    from pretrained_speed import _sentences
    from sentence_transformers import SentenceTransformer

    import qkv
    from qkv.assets import asset_path

    enc = qkv.load("minilm")
    st = SentenceTransformer(str(asset_path("minilm")), device="cpu")
    sents = _sentences(args.sentences)
    ours = enc.embed(sents, batch_size=32)
    ref = st.encode(sents, batch_size=32, convert_to_tensor=True, show_progress_bar=False).cpu().float()
    diff = (ours - ref).abs().max().item()
    print(f"MiniLM, {len(sents)} sentences: embeddings vs sentence-transformers max |diff| {diff:.2e}",
          flush=True)
    return {"sentences": len(sents), "embeddings_max_abs_diff": diff}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200 positions, 200 sentences")
    p.add_argument("--positions", type=int, default=1000, help="teacher-forced positions of held text")
    p.add_argument("--sentences", type=int, default=1000, help="MiniLM sentences compared")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    p.add_argument("--bf16-chat-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bf16_chat_probe:
        import json

        print(json.dumps(bf16_chat()))
        return 0
    if args.quick:
        args.positions, args.sentences = 200, 200
    if args.threads:
        torch.set_num_threads(args.threads)
    if not C.have_reference(NAME):
        return 2
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    meter = C.LoadMeter()
    result = {"machine": machine, "quick": args.quick, "smollm2": smollm2_parity(args),
              "smollm2_bf16_on_avx2_kernels": bf16_chat_on_avx2_kernels(),
              "minilm": minilm_parity(args), "load": meter.stop()}
    print(C.load_line(result["load"]))
    print(f"results: {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
