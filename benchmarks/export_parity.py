"""Train here, run anywhere: a qkv-trained GPT exported with `qkv export`, its file sizes per
format and dtype, and llama.cpp decoding the exported GGUF against qkv decoding the run.

A llama-style GPT (RoPE, RMSNorm, SwiGLU, GQA 4/2 heads, no biases, a byte-level BPE of 512
tokens) is trained on the Shakespeare asset cut into documents (every block between blank lines,
a speech, ends with ``<|endoftext|>``, so the model learns to end a speech), or on ``--data``;
it is exported to Hugging Face format and to GGUF in every ``--dtype``; each file's size is
recorded. Then llama.cpp's ``llama-simple`` (greedy decoding; built from the llama-cpp-python
sdist once, see benchmarks/_llama_cpp.py) continues prompts from the f32 GGUF, and ``qkv
generate RUN --temperature 0`` continues the same prompts from the run itself: the texts are
compared, and whether each stopped at the end of text before ``--new-tokens``. A second run with
biases on q/k/v (``--qkv_bias true``, exported as llama.cpp's ``qwen2``) and a third of qkv's
default GPT (learned positions, LayerNorm, exact GELU, exported as ``gpt2``, whose file computes
GELU's tanh form) are compared the same way; for each, the largest logit difference between
the run and its f32 GGUF read back by qkv is recorded.

    python benchmarks/export_parity.py                # ~1 minute (+ ~10 for a first llama.cpp build)
    python benchmarks/export_parity.py --quick
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C
import _llama_cpp

NAME = "export_parity"
PROMPTS = ["ROMEO:", "The king", "JULIET:\nO", "What light"]
BPE = ["--tokenizer", "bpe", "--bpe_vocab_size", "512"]
LLAMA_STYLE = ["--positions", "rope", "--norm", "rmsnorm", "--mlp", "swiglu", "--n_kv_heads", "2",
               "--bias", "false", *BPE]
# (GGUF architecture, training options): llama-style, the same with biases on q/k/v (qwen2), and
# qkv's default GPT (learned positions, LayerNorm, exact GELU: the file computes the tanh form)
ARCHITECTURES = [("llama", LLAMA_STYLE), ("qwen2", [*LLAMA_STYLE, "--qkv_bias", "true"]), ("gpt2", BPE)]


def logit_gap(run: Path, gguf: Path, text: str) -> float:
    """Largest |logit| difference between the run and its GGUF read back by qkv (fp32)."""
    import torch

    import qkv

    ours, back = qkv.load(run), qkv.load(str(gguf), weights="fp32")
    x = torch.tensor([ours.tokenizer.encode(text)])
    with torch.no_grad():
        return (ours.model(x).logits - back.model(x).logits).abs().max().item()


def qkv_cli(*args: str) -> tuple[str, str]:
    """(stdout, stderr) of one qkv command; exits on failure."""
    r = subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"qkv {' '.join(args[:3])} failed: {r.stderr.strip()[-800:]}")
    return r.stdout, r.stderr


def documents_text(path: Path) -> Path:
    """The Shakespeare asset with ``<|endoftext|>`` after every block between blank lines."""
    from qkv.data.corpora import load_text
    from qkv.tokenizers import END_OF_TEXT

    blocks = [b.strip("\n") for b in load_text(None).text.split("\n\n")]
    path.write_text("".join(b + "\n" + END_OF_TEXT for b in blocks if b), encoding="utf-8")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100 steps, 2 prompts")
    p.add_argument("--data", default=None, help="a text file (default: the Shakespeare asset)")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--new-tokens", type=int, default=40, help="tokens each decoder adds")
    p.add_argument("--no-build", action="store_true", help="do not build llama.cpp if it is missing")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    steps, prompts = (100, PROMPTS[:2]) if args.quick else (args.steps, PROMPTS)
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    simple, how = _llama_cpp.llama_tool("llama-simple", build=not args.no_build)
    print(f"llama.cpp llama-simple: {how}", flush=True)
    meter = C.LoadMeter()
    rows: list[dict] = []
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = ["--data", args.data or str(documents_text(Path(tmp) / "documents.txt"))]
        gaps = {}
        for arch, options in ARCHITECTURES:
            run = Path(tmp) / arch
            qkv_cli("train", "--preset", "cpu", *options, *data, "--max_iters", str(steps),
                    "--dim", "128", "--n_layers", "4", "--n_heads", "4", "--max_seq_len", "128",
                    "--out_dir", str(run), "--no-progress", "--compile", "false", "--optimizer", "adamw")
            dtypes = ("f32", "f16", "bf16", "q8_0") if arch == "llama" else ("f32",)
            if arch == "llama":  # sizes of one run in every format
                sizes["qkv run (model.safetensors)"] = (run / "model.safetensors").stat().st_size
                qkv_cli("export", str(run), "--format", "hf", "-o", str(Path(tmp) / "hf"))
                sizes["hf (model.safetensors, f32)"] = (Path(tmp) / "hf" / "model.safetensors").stat().st_size
            for dtype in dtypes:
                out = Path(tmp) / f"{arch}-gguf-{dtype}"
                qkv_cli("export", str(run), "--format", "gguf", "--dtype", dtype, "-o", str(out))
                if arch == "llama":
                    sizes[f"gguf {dtype}"] = (out / "model.gguf").stat().st_size
            gaps[arch] = logit_gap(run, Path(tmp) / f"{arch}-gguf-f32" / "model.gguf",
                                   "ROMEO:\nBut soft, what light through yonder window breaks?")
            for prompt in prompts:
                ours, err = qkv_cli("generate", str(run), "--prompt", prompt, "--temperature", "0",
                                    "--max-new-tokens", str(args.new_tokens))
                ours = ours.rstrip("\n")
                n_ours = int(err.rsplit("[", 1)[1].split()[0])  # "[N tokens in ...]"
                theirs = None
                if simple is not None:
                    theirs = _llama_cpp.simple_text(simple, Path(tmp) / f"{arch}-gguf-f32" / "model.gguf",
                                                    prompt, args.new_tokens)
                # Both stop at <|endoftext|> (the GGUF names it as eos), without printing it.
                rows.append({"architecture": arch, "prompt": prompt, "qkv": ours, "llama_cpp": theirs,
                             "same": theirs == ours, "qkv_new_tokens": n_ours,
                             "qkv_stopped_at_end_of_text": n_ours < args.new_tokens})
    load = meter.stop()
    C.print_table("exported file sizes", ["file", "bytes", "size"],
                  [[k, f"{v:,}", C.fmt_bytes(v)] for k, v in sizes.items()])
    C.print_table("greedy continuations: qkv (the run) vs llama.cpp (the f32 GGUF export)",
                  ["GGUF", "prompt", "same text", "qkv tokens", "ended at <|endoftext|>", "llama.cpp",
                   "qkv"],
                  [[r["architecture"], r["prompt"], str(r["same"]), str(r["qkv_new_tokens"]),
                    str(r["qkv_stopped_at_end_of_text"]), repr((r["llama_cpp"] or "")[:60]),
                    repr(r["qkv"][:60])] for r in rows])
    result = {"machine": machine, "steps": steps, "llama_simple": how, "sizes": sizes, "rows": rows,
              "load": load,
              "architectures": ARCHITECTURES, "logit_gap_run_vs_gguf_f32": gaps}
    print("largest |logit| gap, run vs its f32 GGUF (read by qkv): "
          + ", ".join(f"{a} {g:.2e}" for a, g in gaps.items()))
    print(C.load_line(load))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
