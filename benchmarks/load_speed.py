"""How long loading takes, per format, in qkv and in `transformers`, on the same files.

Formats: SmolLM2-135M's GGUF (the installed asset, Q4_1; qkv converting it, qkv from its
conversion cache, and `transformers` with ``gguf_file=``), the same weights as a Hugging Face
folder (written once by `transformers` from the GGUF, float32 safetensors), a random 4-layer
Llama as a Hugging Face folder, a qkv run directory (the `tiny` preset), and a 4-layer Llama of
the same widths trained by qkv (1 step, its own 2,048-token BPE) in all three formats: its run
directory, and its `qkv export` to a Hugging Face folder and to an f32 GGUF. Every load runs
in a fresh process (so no tool gets a warm import or allocator) and is timed around the load
calls alone (model and tokenizer: `qkv.load` returns both, so `transformers` loads its
`AutoTokenizer` too), in round-robin order over ``--rounds``; the files are read once beforehand, so
the OS file cache is warm for everyone. Reported: the median seconds and qkv's speed-up.

    python benchmarks/load_speed.py              # ~2 minutes on 2 cores (AMD EPYC Zen 5)
    python benchmarks/load_speed.py --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C

NAME = "load_speed"
HERE = Path(__file__).resolve()


def child(tool: str, what: str, target: str) -> None:
    """Time one load in this (fresh) process; print {"seconds": s} as JSON."""
    import time

    import torch

    torch.set_num_threads(2)
    if tool == "transformers":
        import transformers

        t0 = time.perf_counter()  # the model and its tokenizer, as qkv.load gives both
        if what == "gguf":
            folder, name = os.path.split(target)
            transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        else:
            transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
            transformers.AutoTokenizer.from_pretrained(target)
    else:
        import qkv

        t0 = time.perf_counter()
        if what == "gguf":
            qkv.load("smollm2", path=target, weights="fp32", cache=False)
        elif what == "gguf-cached":
            qkv.load("smollm2", path=target, weights="fp32", cache=True)
        elif what == "run":
            qkv.load(target)  # a GPT run directory -> CausalLM
        elif what == "gguf-file":  # any GGUF by its architecture, converted afresh
            qkv.load(target, weights="fp32", cache=False)
        else:
            qkv.load(target, weights="fp32")
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def timed(tool: str, what: str, target: str, env: dict) -> float:
    out = subprocess.run([sys.executable, str(HERE), "--child", tool, what, target], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tool} {what} {target} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def prepare(tmp: Path) -> dict[str, str]:
    """The files: SmolLM2's GGUF, that model as an HF folder, a random 4-layer Llama folder,
    a tiny qkv run."""
    import torch
    import transformers

    from qkv.assets import asset_path

    gguf = asset_path("smollm2")
    folder, name = os.path.split(gguf)
    smol = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in smol.config.to_dict().items()
                                               if k != "quantization_config"})
    plain = transformers.AutoModelForCausalLM.from_config(cfg).float()  # a model transformers can save
    plain.load_state_dict(smol.state_dict())
    plain.save_pretrained(tmp / "smollm2-hf")
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp / "smollm2-hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=smol.config.vocab_size, hidden_size=512, intermediate_size=1536,
                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=2048)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(tmp / "llama4-hf")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's vocabulary
        shutil.copy(tmp / "smollm2-hf" / f, tmp / "llama4-hf")
    (tmp / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200, encoding="utf-8")
    run = tmp / "run"
    qkv_cli("train", "--preset", "tiny", "--data", str(tmp / "text.txt"), "--max_iters", "2",
            "--out_dir", str(run), "--no-progress", "--compile", "false")
    # the same 4-layer Llama shape as a qkv run (1 step), exported by qkv to HF and to GGUF f32
    qkv_cli("train", "--preset", "tiny", "--max_iters", "1",  # on Shakespeare, for a full 2,048 BPE
            "--positions", "rope", "--norm", "rmsnorm", "--mlp", "swiglu", "--dim", "512", "--n_layers", "4",
            "--n_heads", "8", "--n_kv_heads", "4", "--mlp_hidden", "1536", "--max_seq_len", "256",
            "--tokenizer", "bpe", "--out_dir", str(tmp / "llama4-run"), "--no-progress", "--compile", "false")
    qkv_cli("export", str(tmp / "llama4-run"), "--format", "hf", "-o", str(tmp / "llama4-export-hf"))
    qkv_cli("export", str(tmp / "llama4-run"), "--format", "gguf", "-o", str(tmp / "llama4-export-gguf"))
    return {"gguf": str(gguf), "smollm2-hf": str(tmp / "smollm2-hf"), "llama4-hf": str(tmp / "llama4-hf"),
            "run": str(run), "llama4-run": str(tmp / "llama4-run"),
            "llama4-export-hf": str(tmp / "llama4-export-hf"),
            "llama4-export-gguf": str(tmp / "llama4-export-gguf" / "model.gguf")}


def qkv_cli(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"qkv {' '.join(args[:2])} failed:\n{out.stderr[-2000:]}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds (median reported)")
    p.add_argument("--quick", action="store_true", help="one round")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    if not C.have_reference(NAME, ("smollm2",)):
        return 2
    rounds = 1 if args.quick else args.rounds
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = prepare(Path(tmp))
        env = {**os.environ, "QKV_CACHE_DIR": str(Path(tmp) / "cache"), "OMP_NUM_THREADS": "2"}
        cases = [  # (row, tool, what, target)
            ("SmolLM2 GGUF (Q4_1, dequantised)", "qkv", "gguf", files["gguf"]),
            ("SmolLM2 GGUF (Q4_1, dequantised)", "transformers", "gguf", files["gguf"]),
            ("SmolLM2 GGUF, qkv's conversion cache", "qkv", "gguf-cached", files["gguf"]),
            ("SmolLM2 HF folder (fp32 safetensors)", "qkv", "hf", files["smollm2-hf"]),
            ("SmolLM2 HF folder (fp32 safetensors)", "transformers", "hf", files["smollm2-hf"]),
            ("random 4-layer Llama HF folder", "qkv", "hf", files["llama4-hf"]),
            ("random 4-layer Llama HF folder", "transformers", "hf", files["llama4-hf"]),
            ("qkv run directory (tiny preset)", "qkv", "run", files["run"]),
            ("4-layer Llama (qkv-trained, 2,048 BPE): qkv run", "qkv", "run", files["llama4-run"]),
            ("4-layer Llama (qkv-trained): its HF export", "qkv", "hf", files["llama4-export-hf"]),
            ("4-layer Llama (qkv-trained): its HF export", "transformers", "hf", files["llama4-export-hf"]),
            ("4-layer Llama (qkv-trained): its GGUF f32 export", "qkv", "gguf-file",
             files["llama4-export-gguf"]),
            ("4-layer Llama (qkv-trained): its GGUF f32 export", "transformers", "gguf",
             files["llama4-export-gguf"]),
        ]
        timed("qkv", "gguf-cached", files["gguf"], env)  # fills the conversion cache
        for _, tool, what, target in cases:  # warm the OS file cache and the imports' .pyc files
            timed(tool, what, target, env)
        meter = C.LoadMeter()
        samples: dict[tuple[str, str], list[float]] = {(r, t): [] for r, t, _, _ in cases}
        for k in range(rounds):
            order = cases if k % 2 == 0 else cases[::-1]
            for row, tool, what, target in order:
                samples[(row, tool)].append(timed(tool, what, target, env))
        load = meter.stop()
    rows, table = [], []
    for row in dict.fromkeys(r for r, _, _, _ in cases):
        q = C.median(samples[(row, "qkv")]) if (row, "qkv") in samples else None
        t = C.median(samples[(row, "transformers")]) if (row, "transformers") in samples else None
        rows.append({"format": row, "qkv_s": q, "transformers_s": t,
                     "samples": {tool: samples[(r, tool)] for r, tool in samples if r == row}})
        table.append([row, f"{q:.2f} s" if q is not None else "—", f"{t:.2f} s" if t is not None else "—",
                      f"{t / q:.1f}×" if q and t else "—"])
    C.print_table(f"load time, median of {rounds} fresh processes each", ["format", "qkv", "transformers",
                  "qkv's speed-up"], table)
    result = {"machine": machine, "rounds": rounds, "rows": rows, "load": load}
    print(C.load_line(load))
    print(f"wrote {C.write_json(NAME + ('_quick' if args.quick else ''), result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
