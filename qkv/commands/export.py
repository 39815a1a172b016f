"""`qkv export`: a GPT run from `qkv train` as a Hugging Face checkpoint folder or a GGUF file
(:mod:`qkv.pretrained.export`)."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained GPT run as a Hugging Face folder or a GGUF file",
        description="Export the best weights and the tokenizer of a GPT run directory from `qkv train`. "
        "A GPT with learned positions, LayerNorm and a GELU/ReLU MLP becomes Hugging Face's gpt2; one "
        "with RoPE, RMSNorm and SwiGLU (grouped-query heads allowed) becomes llama. Any other "
        "combination (sinusoidal/ALiBi/no positions, RMSNorm with learned positions, LayerNorm with "
        "RoPE, GeGLU, --embed_scale, GQA or a custom head_dim with learned positions) is refused, "
        "naming the option. Missing biases are written as zeros (exact). A BPE run's <|endoftext|> "
        "becomes the bos/eos token, so transformers and llama.cpp stop where `qkv generate` does (a "
        "character run, or a BPE run trained before qkv reserved that token, has none: generation runs "
        "to its length limit, and llama.cpp takes id 11 as its end of text). The optimizer state and "
        "metrics are not exported.",
        epilog="formats:\n"
        "  hf    OUT/ holds config.json, generation_config.json (qkv generate's sampling defaults),\n"
        "        model.safetensors (float32, HF names and layouts), tokenizer.json, tokenizer_config.json;\n"
        "        transformers' AutoModelForCausalLM.from_pretrained(OUT) "
        "and qkv.load(OUT) read it\n"
        "  gguf  OUT if it ends in .gguf (as llama.cpp's converter's --outfile), else OUT/model.gguf:\n"
        "        runs with a BPE tokenizer, as llama.cpp's gpt2, llama or (a llama-style\n"
        "        run with --qkv_bias true) qwen2: its tensor names and layouts, tokenizer metadata.\n"
        "        A gpt2 file computes GELU's tanh form (llama.cpp's); an exact-GELU run is written with\n"
        "        a note (logits a few 1e-3 apart). transformers reads gpt2 GGUFs of 1024-token runs only.\n"
        "        Refused: --mlp relu with learned positions, --bias true on a llama-style run (neither\n"
        "        llama nor qwen2 takes biases everywhere), a character tokenizer\n"
        "        (GGUF's gpt2 tokenizer is byte-level, which a character vocabulary is not)\n"
        "dtypes (--format gguf): f32, f16, bf16, q8_0 (8-bit blocks of 32 with an f16 scale), q4_0\n"
        "  (4-bit blocks of 32 with an f16 scale); 1-D tensors (norms) stay f32, and under q8_0 and\n"
        "  q4_0 a matrix whose rows are not a multiple of 32 is f16\n"
        "OUT must not exist (or be an empty folder): nothing is overwritten; the files are written "
        "into\na temporary file or folder beside OUT and renamed when complete.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a GPT run directory from `qkv train`")
    p.add_argument("--format", default="hf", choices=("hf", "gguf"), help="output format (default hf)")
    p.add_argument("-o", "--out", required=True, metavar="OUT",
                   help="the folder to create, or (--format gguf) the .gguf file")
    p.add_argument("--dtype", default="f32", choices=DTYPES,
                   help="GGUF tensor type (default f32; hf is always f32)")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from qkv.inference import open_model
    from qkv.pretrained.exporter import export_model
    from qkv.tokenizers import end_of_text_id

    loaded = open_model(args.run, weights="fp32", family="gpt")
    out, arch = export_model(loaded.model, loaded.tokenizer, args.out, args.format, args.dtype)
    what = "Hugging Face folder" if args.format == "hf" else f"GGUF ({args.dtype})"
    print(f"exported {args.run} as {arch} ({what}): {out}")
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else [f"{out.stat().st_size:,} bytes"]
    print("  " + ", ".join(files), file=sys.stdout)
    if args.format == "gguf":
        from qkv.pretrained.export_gguf import gguf_notes

        for note in gguf_notes(loaded.model.cfg):
            print(f"  note: {note}", file=sys.stderr)
    if end_of_text_id(loaded.tokenizer) is None:
        why = ("a BPE run trained before qkv reserved <|endoftext|>" if hasattr(loaded.tokenizer, "tokenizer")
               else "a character tokenizer")
        stop = "; llama.cpp takes id 11 as its end of text" if args.format == "gguf" else ""
        print(f"  note: no end-of-text token ({why}): generation runs to its length limit{stop}; "
              "retrain with --tokenizer bpe to get one", file=sys.stderr)
    return 0
