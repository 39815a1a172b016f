"""`qkv lens MODEL --prompt TEXT`: what a model does with a text, not only where it looks.

    --probs              the next-token distribution (the default view), at --temperature
    --logit-lens         what each layer would predict at each position
    --ablate L.H,...     knock heads out: the prediction and the loss before and after
    --effects            every head's effect on the loss (or on --answer vs --wrong)
    --heads              name heads: previous-token, first-token, duplicate-token, induction;
                         --by-effect: also what knocking each out does to the repeat's loss
    --patch --corrupt T  activation patching from the prompt into T (--site resid | head | query |
                         key | value; --metric diff | prob | loss); --estimate: every cell at once
                         by attribution patching (--qk-fix, --grad-drop, --ig-steps: AtP*, IG),
                         --compare: both; --edges: the paths between components (EAP, EAP-IG)
    --attribute ANSWER   direct logit attribution of ANSWER (vs --wrong) to each head and MLP
    --qk L.H             one head's attention row term by term: q·k, / √d, softmax (--query)
    --rollout            attention rollout through every layer (Abnar & Zuidema 2020)

Tables go to the terminal; ``-o`` writes the view as a picture (.png, .svg, .pdf) or as
``.json``, and ``--json`` prints JSON. The numbers come from :mod:`qkv.lens`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from qkv.commands.options import LONG_TEXT_RULE

VIEWS = ("probs", "logit_lens", "ablate", "effects", "heads", "patch", "attribute", "qk", "rollout")


def add_lens_parser(sub) -> None:
    p = sub.add_parser(
        "lens",
        help="what a model does: next-token probabilities, logit lens, head ablation and effects, "
        "head types, activation patching, logit attribution",
        description="Look inside MODEL as it reads --prompt: the next-token distribution (--probs, "
        "the default), what each layer would predict (--logit-lens), what knocking heads out changes "
        "(--ablate 3.1,5.0; --effects for every head), which heads are previous-token, first-token, "
        "duplicate-token or induction heads (--heads), which activations carry the difference between "
        "two prompts (--patch --corrupt TEXT; --estimate: attribution patching's estimate of every cell "
        "from two forward passes and one backward pass, with AtP*'s --qk-fix and --grad-drop or integrated "
        "gradients, --ig-steps; --compare: both, and how well they agree; --edges: the strongest paths "
        "between heads and MLPs by edge attribution patching, EAP or EAP-IG), and "
        "how much each head and MLP writes towards an answer "
        "(--attribute ANSWER [--wrong W]); one head's attention row term by term: q·k, / √d, "
        "softmax (--qk LAYER.HEAD [--query N]); the attention rollout through every layer (--rollout). "
        "Decoders (GPT runs, smollm2, Hugging Face folders and "
        "GGUF files of llama, mistral, qwen2, gemma, gpt2) have every view; encoders (minilm, BERT) "
        "have --ablate, --effects, --heads, --qk and --rollout. Heads are numbered from 0 as LAYER.HEAD. "
        "Several "
        "views may be asked at once; -o NAME.png writes one picture per view (NAME-view.png when "
        "there are several), -o NAME.json or --json the numbers. " + LONG_TEXT_RULE,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_OR_RUN",
                   help="smollm2, minilm, a run directory from `qkv train gpt`, a Hugging Face folder or a "
                   ".gguf file; a bundled name always means the bundled model (a folder of that name: "
                   "./NAME)")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="the prompt (or use --prompt)")
    p.add_argument("--prompt", default=None, help="the text to read")
    v = p.add_argument_group("views (default: --probs)")
    v.add_argument("--probs", action="store_true", help="the next-token distribution: the top -k tokens")
    v.add_argument("--logit-lens", action="store_true",
                   help="each layer's prediction at each position (the final norm recomputed per layer)")
    v.add_argument("--ablate", default=None, metavar="L.H,...",
                   help="knock out these heads (e.g. 0.1,2.3): next token and loss before and after")
    v.add_argument("--effects", action="store_true",
                   help="knock out every head in turn: its effect on the loss (or on --answer vs --wrong)")
    v.add_argument("--heads", action="store_true",
                   help="score every head on repeated random tokens: previous-token, first-token, "
                   "duplicate-token, induction")
    v.add_argument("--patch", action="store_true",
                   help="patch the prompt's activations into --corrupt, cell by cell (--site)")
    v.add_argument("--attribute", default=None, metavar="ANSWER",
                   help="direct logit attribution of ANSWER (one token; mind a leading space) at the "
                   "last position, against --wrong if given")
    v.add_argument("--qk", default=None, metavar="L.H",
                   help="one head's scores for one query token (--query), term by term: q·k for each key "
                   "(after RoPE where the model uses it), divided by √d, and the softmax: CS189 "
                   "Discussion 10 on a real model")
    v.add_argument("--rollout", action="store_true",
                   help="attention rollout: how much of each output token comes from each input token "
                   "through every layer, the residual counted (Abnar & Zuidema 2020; as qkv attend shows "
                   "for ViT)")
    o = p.add_argument_group("options")
    o.add_argument("--query", type=int, default=-1, help="--qk: the query token's position (-1: the last)")
    o.add_argument("--corrupt", default=None, help="--patch: the corrupted prompt (same number of tokens)")
    o.add_argument("--site", choices=("resid", "head", "query", "key", "value"), default="resid",
                   help="--patch: the residual stream (layer x position), each head's output (layer x "
                   "head), or one input of each head's attention (its queries, keys or values at every "
                   "position, the softmax recomputed)")
    o.add_argument("--metric", choices=("diff", "prob", "loss"), default="diff",
                   help="--patch: what is measured at the last position: the answer's logit minus the wrong "
                   "one's, the answer's probability, or its cross-entropy")
    o.add_argument("--by-effect", action="store_true",
                   help="--heads: also knock each head out and measure how much the loss on the repeat "
                   "rises: heads named by what they do (copying), not only by where they look (a pass per "
                   "head: seconds on a small model, ~2.5 minutes for SmolLM2's 270 heads on 2 cores)")
    o.add_argument("--estimate", action="store_true",
                   help="--patch: estimate every cell at once by attribution patching, (clean - corrupt) x "
                   "the gradient at the corrupt run (Nanda 2023): a second instead of a pass per cell; "
                   "float weights only")
    o.add_argument("--qk-fix", action="store_true",
                   help="--estimate --site query|key: AtP*'s QK fix (Kramar et al. 2024): each head's "
                   "attention recomputed exactly with the clean queries (keys), only the rest linearised: "
                   "no false negatives where a softmax is saturated")
    o.add_argument("--grad-drop", action="store_true",
                   help="--estimate: also AtP*'s GradDrop (a backward pass per layer with its gradient "
                   "dropped): cells whose direct and indirect effects cancel are flagged")
    o.add_argument("--ig-steps", type=int, default=0, metavar="M",
                   help="--estimate / --edges: integrated gradients, the gradient averaged at M points from "
                   "the corrupt to the clean input (M more passes; EAP-IG for --edges); 0: the corrupt run's")
    o.add_argument("--edges", action="store_true",
                   help="--patch: edge attribution patching (EAP; EAP-IG with --ig-steps): the strongest "
                   "paths from the embedding, heads and MLPs into each head's q/k/v, each MLP and the "
                   "output, as a table and (-o) a graph")
    o.add_argument("--compare", action="store_true",
                   help="--patch --estimate: also run the exact sweep and say how well the two agree "
                   "(Spearman's rank correlation, top -k recall)")
    o.add_argument("--answer", default=None, help="--patch / --effects: the answer token (default for "
                   "--patch: the prompt's top prediction)")
    o.add_argument("--wrong", default=None, help="--patch / --effects / --attribute: the token to compare "
                   "against (default for --patch: the corrupt prompt's top prediction)")
    o.add_argument("--mode", choices=("zero", "mean"), default="zero",
                   help="--ablate / --effects: replace a head's output by zero or by its mean over "
                   "the prompt")
    o.add_argument("--temperature", type=float, default=1.0, help="--probs: softmax(logits / T)")
    o.add_argument("-k", "--top", type=int, default=10, help="how many tokens or rows a table shows")
    o.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8", "q4"),
                   help="how a decoder's weights are held (fp32: exact to the reference)")
    o.add_argument("-o", "--out", default=None,
                   help="write the view: a picture (.png, .svg, .pdf) or its numbers (.json)")
    o.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")
    p.set_defaults(func=cmd_lens, extra_texts=True)


def _views(args: argparse.Namespace) -> list[str]:
    chosen = [name for name in VIEWS if getattr(args, name) not in (None, False)]
    return chosen or ["probs"]


def _out_paths(out: str | None, views: list[str]) -> dict[str, Path]:
    from qkv.commands.options import PICTURE_SUFFIXES, check_picture_out

    if out is None:
        return {}
    path = check_picture_out(out, "-o/--out", (*PICTURE_SUFFIXES, ".json"))
    if len(views) == 1:
        return {views[0]: path}
    return {v: path.with_name(f"{path.stem}-{v.replace('_', '-')}{path.suffix}") for v in views}


def cmd_lens(args: argparse.Namespace) -> int:
    from qkv import lens
    from qkv.commands.lens_views import VIEW_FUNCTIONS
    from qkv.inference import open_model
    from qkv.inference.loading import resolve_model

    if args.prompt is not None and args.texts:
        raise ValueError("give the prompt once: as --prompt or as arguments, not both")
    text = args.prompt if args.prompt is not None else " ".join(args.texts)
    views = _views(args)
    if args.patch and args.corrupt is None:
        raise ValueError("--patch needs --corrupt TEXT: the prompt to patch into (same number of tokens)")
    if args.corrupt is not None and not args.patch:
        raise ValueError("--corrupt is for --patch; add --patch")
    if (args.estimate or args.compare) and not args.patch:
        raise ValueError("--estimate and --compare are for --patch; add --patch --corrupt TEXT")
    if args.edges and not args.patch:
        raise ValueError("--edges is for --patch; add --patch --corrupt TEXT")
    if (args.qk_fix or args.grad_drop) and not args.estimate:
        raise ValueError("--qk-fix and --grad-drop refine attribution patching's estimate; add --estimate")
    if args.ig_steps and not (args.estimate or args.edges):
        raise ValueError("--ig-steps is for --estimate or --edges")
    if args.ig_steps < 0:
        raise ValueError(f"--ig-steps must be >= 0, got {args.ig_steps}")
    if args.qk_fix and args.site not in ("query", "key"):
        raise ValueError("--qk-fix recomputes attention when queries or keys are patched: add --site query "
                         "or --site key")
    if args.edges and (args.estimate or args.site != "resid"):
        raise ValueError("--edges estimates every edge between components; it takes no --estimate or --site")
    if args.by_effect and not args.heads:
        raise ValueError("--by-effect is for --heads; add --heads")
    if args.compare and not args.estimate:
        raise ValueError("--compare compares the estimate with the exact sweep; add --estimate")
    if args.top < 1:
        raise ValueError(f"-k/--top must be >= 1, got {args.top}")
    heads = lens.parse_heads(args.ablate) if args.ablate is not None else None
    outs = _out_paths(args.out, views)
    if not text.strip() and views != ["heads"]:
        raise ValueError("give a prompt: qkv lens MODEL --prompt \"...\"")
    ref = resolve_model(args.model)
    if ref.note:
        print(f"qkv: note: {ref.note}", file=sys.stderr)
    if ref.kind not in ("decoder", "encoder"):
        what = "run" if ref.source == "run" else "model"
        raise ValueError(f"{args.model} is a {ref.label} {what}: the lens "
                         "reads text models made of attention heads (GPT runs, decoders, encoders); "
                         "use qkv attend for its attention")
    decoder_only = {"probs", "logit_lens", "patch", "attribute"} & set(views)
    if ref.kind == "encoder" and decoder_only:
        names = ", ".join("--" + v.replace("_", "-") for v in sorted(decoder_only))
        raise ValueError(f"{args.model} is an encoder: it predicts no next token, so {names} do not apply "
                         "(--ablate, --effects and --heads do)")
    lm = open_model(ref, weights=args.weights if ref.kind == "decoder" else None)
    results: dict[str, Any] = {}
    for view in views:
        results[view] = VIEW_FUNCTIONS[view](lm, text, args, heads, outs.get(view))
    if args.json:
        json.dump(results if len(views) > 1 else results[views[0]], sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    return 0
