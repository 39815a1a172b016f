"""The views of `qkv lens`: each computes one :mod:`qkv.lens` result, prints it as a table (unless
--json), writes it to -o as a picture or JSON, and returns its numbers as plain data."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def console():
    from rich.console import Console

    return Console()


def _show(x: str) -> str:
    """A token as a table shows it: :func:`qkv.viz.tokens.show_token` (␣ ↵ ⇥ for whitespace)."""
    from qkv.viz.tokens import show_token

    return show_token(x)


def _write(out: Path | None, data: dict[str, Any], figure: Any) -> None:
    if out is None:
        return
    if out.suffix.lower() == ".json":
        from qkv.fileio import atomic_write

        body = json.dumps(data, ensure_ascii=False) + "\n"
        atomic_write(out, lambda p: p.write_text(body, encoding="utf-8"))
    else:
        from qkv.viz import draw

        draw(figure, out)
    console().print(f"wrote {out}", highlight=False)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    console().print(t)


def view_probs(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Bars

    nt = lens.next_token(lm, text, temperature=args.temperature, k=args.top)
    data = {"temperature": nt.temperature, "tokens": nt.tokens,
            "top": [{"id": p.id, "token": p.token, "prob": p.prob, "logit": p.logit} for p in nt.top]}
    if not args.json:
        _table(f"next token after {len(nt.tokens)} tokens, temperature {nt.temperature:g}",
               ["token", "probability", "logit"],
               [[_show(p.token), f"{p.prob:.4f}", f"{p.logit:.3f}"] for p in nt.top])
    _write(out, data, Bars([_show(p.token) for p in nt.top], [p.prob for p in nt.top],
                           f"{lm.name}: next token (T = {nt.temperature:g})", "probability"))
    return data


def view_logit_lens(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Heatmap

    ll = lens.logit_lens(lm, text)
    probs, ids = ll.top(1)
    probs, ids = probs[..., 0], ids[..., 0]  # (L + 1, T)
    dec = lm.tokenizer.decode
    cells = [[dec([int(i)]) for i in row] for row in ids]
    data = {"rows": ll.rows, "tokens": ll.tokens, "top_token": cells, "top_prob": probs.tolist()}
    if not args.json:
        last = list(range(max(0, len(ll.tokens) - args.top), len(ll.tokens)))
        _table(f"logit lens: each layer's top prediction (and its probability) after the last {len(last)} "
               "tokens", ["layer", *(_show(ll.tokens[t]) for t in last)],
               [[r, *(f"{_show(cells[i][t])} {float(probs[i, t]):.2f}" for t in last)]
                for i, r in enumerate(ll.rows)])
    title = f"{lm.name}: logit lens (top token, its probability)"
    _write(out, data, Heatmap(probs, ll.rows, ll.tokens, title, cells, "probability of the top token"))
    return data


def view_ablate(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from qkv import lens
    from qkv.figures import Bars
    from qkv.lens.cache import encode

    heads = lens.causal.check_heads(lm, heads)
    names = ",".join(f"{layer}.{h}" for layer, h in heads)
    ids = encode(lm, text)
    before = lens.ablate(lm, text, [], mode=args.mode)
    after = lens.ablate(lm, text, heads, mode=args.mode)
    data: dict[str, Any] = {"heads": [list(h) for h in heads], "mode": args.mode}
    if lm.kind == "encoder":
        change = 1 - float(F.cosine_similarity(before.mean(0), after.mean(0), dim=0))
        data["embedding_change"] = change
        if not args.json:
            console().print(f"knocking out {names} ({args.mode}) changes the sentence embedding by "
                            f"1 - cos = {change:.4f}", highlight=False)
        _write(out, data, Bars([names], [change], f"{lm.name}: embedding change", "1 - cosine"))
        return data
    tgt = torch.tensor(ids[1:])
    loss = [float(F.cross_entropy(x[:-1].double(), tgt)) if len(ids) > 1 else float("nan")
            for x in (before, after)]
    p0, p1 = torch.softmax(before[-1].double(), -1), torch.softmax(after[-1].double(), -1)
    top = (p0 + p1).topk(min(args.top, p0.numel())).indices.tolist()
    dec = lm.tokenizer.decode
    data.update(loss_before=loss[0], loss_after=loss[1],
                top=[{"id": i, "token": dec([i]), "before": float(p0[i]), "after": float(p1[i])}
                     for i in top])
    if not args.json:
        _table(f"knocking out {names} ({args.mode}): loss over the prompt {loss[0]:.4f} -> {loss[1]:.4f}",
               ["next token", "before", "after", "change"],
               [[_show(dec([i])), f"{float(p0[i]):.4f}", f"{float(p1[i]):.4f}",
                 f"{float(p1[i] - p0[i]):+.4f}"] for i in top])
    _write(out, data, Bars([_show(dec([i])) for i in top], [float(p1[i] - p0[i]) for i in top],
                           f"{lm.name}: next token with {names} knocked out", "change in probability"))
    return data


def view_effects(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Heatmap

    eff = lens.head_effects(lm, text, mode=args.mode, answer=args.answer, wrong=args.wrong)
    e = eff.effect
    L, H = e.shape
    data = {"metric": eff.metric, "mode": eff.mode, "base": eff.base, "effect": e.tolist()}
    if not args.json:
        order = e.flatten().abs().argsort(descending=True)[: args.top].tolist()
        _table(f"every head knocked out ({eff.mode}): {eff.metric} {eff.base:.4f} unablated; the "
               f"{len(order)} largest changes", ["head", eff.metric, "change"],
               [[f"{i // H}.{i % H}", f"{float(eff.values.flatten()[i]):.4f}",
                 f"{float(e.flatten()[i]):+.4f}"] for i in order])
    _write(out, data, Heatmap(e, [f"layer {i}" for i in range(L)], [str(h) for h in range(H)],
                              f"{lm.name}: change in {eff.metric} with each head knocked out ({eff.mode})",
                              None, f"change in {eff.metric}", diverging=True))
    return data


def view_heads(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Heatmap, Heatmaps

    by_effect = args.by_effect and lm.kind == "decoder"
    sc = lens.head_scores(lm, effects=True) if by_effect else lens.head_scores(lm)
    L, H = sc.previous.shape
    data: dict[str, Any] = {t: s.tolist() for t, s in sc.by_type().items()}
    data.update(labels=sc.labels, threshold=sc.threshold, loss_first=sc.loss_first,
                loss_second=sc.loss_second)
    if sc.copying is not None:
        data.update(copying=sc.copying.tolist(), copy_share=lens.COPY_AT,
                    copiers=[[layer, h, r] for layer, h, r in sc.copiers()])
    if not args.json:
        named = sc.named()
        shown = named[: args.top]
        more = f", the {len(shown)} strongest shown (-k)" if len(shown) < len(named) else ""
        _table(f"heads by type (score >= {sc.threshold} on repeated random tokens); {len(named)} of {L * H} "
               f"named{more}", ["head", "type", "score", *lens.HEAD_TYPES],
               [[f"{layer}.{h}", t, f"{s:.3f}",
                 *(f"{float(sc.by_type()[k][layer, h]):.2f}" for k in lens.HEAD_TYPES)]
                for layer, h, t, s in shown])
        if lm.kind == "decoder":
            console().print(f"loss on the first copy {sc.loss_first:.3f}, on the repeat {sc.loss_second:.3f} "
                            f"(in-context learning score {sc.icl:+.3f})", highlight=False)
        if sc.copying is not None:
            _print_copying(sc, args.top)
    rows, cols = [f"layer {i}" for i in range(L)], [str(h) for h in range(H)]
    panels = [Heatmap(s, rows, cols, t, None, "score") for t, s in sc.by_type().items()]
    if sc.copying is not None:
        panels.append(Heatmap(sc.copying, rows, cols, "copying (knock-out)", None,
                              "nats the repeat's loss rises"))
    _write(out, data, Heatmaps(panels, f"{lm.name}: head scores on repeated random tokens"))
    return data


def _print_copying(sc, top: int) -> None:
    """The heads by what knocking each out does to the repeat's loss, and who copies."""
    from qkv.lens import COPY_AT

    H = sc.copying.shape[1]
    order = sc.copying.flatten().argsort(descending=True)[:top].tolist()
    labels = sc.labels
    _table("heads by what they do: the loss on the repeat with the head knocked out",
           ["head", "loss rises by", "share of the repeat's saving", "named by pattern"],
           [[f"{i // H}.{i % H}", f"{float(sc.copying.flatten()[i]):+.3f}",
             f"{float(sc.copying.flatten()[i]) / sc.saved:.0%}" if sc.saved > 0 else "-",
             labels[i // H][i % H] or "-"] for i in order])
    if not sc.saved > 0:
        line = "the model does not copy: the repeat costs as much as the first copy (nothing to undo)"
    elif sc.copiers():
        names = ", ".join(f"{layer}.{h} (+{r:.2f})" for layer, h, r in sc.copiers()[:top])
        line = (f"copying heads (knocked out, each undoes at least {COPY_AT:.0%} of the {sc.saved:.2f} nats "
                f"a token the repeat saves): {names}")
    else:
        best = int(sc.copying.flatten().argmax())
        line = (f"copying is spread over heads: the repeat saves {sc.saved:.2f} nats a token and no one "
                f"head's knock-out undoes {COPY_AT:.0%} of it (the most: {best // H}.{best % H}, "
                f"+{float(sc.copying.flatten()[best]):.2f})")
    console().print(line, highlight=False)


def view_patch(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Heatmap

    if args.edges:
        return _view_edges(lm, text, args, out)
    kw = dict(site=args.site, answer=args.answer, wrong=args.wrong, metric=args.metric)
    est = (lens.attribution_patch(lm, text, args.corrupt, grad_drop=args.grad_drop, qk_fix=args.qk_fix,
                                  ig_steps=args.ig_steps, **kw) if args.estimate else None)
    exact = exact_s = agree = None
    if est is None or args.compare:
        t0 = time.perf_counter()
        exact = lens.patch(lm, text, args.corrupt, **kw)
        exact_s = time.perf_counter() - t0
    p = est if est is not None else exact
    assert p is not None
    method = "patching"
    if est is not None:
        method = ("attribution patching" + (" + QK fix" if est.qk_fix else "")
                  + (f" + IG ({est.ig_steps} steps)" if est.ig_steps else ""))
    L, C = p.values.shape
    cols = p.clean_tokens if p.site == "resid" else [str(h) for h in range(C)]
    measured = p.measured()
    data: dict[str, Any] = {"site": p.site, "method": method if est is not None else "exact",
                            "metric": p.metric, "answer": p.answer, "wrong": p.wrong,
                            "clean_diff": p.clean_diff, "corrupt_diff": p.corrupt_diff, "columns": cols,
                            "values": p.values.tolist()}
    if est is not None:
        data.update(seconds=round(est.seconds, 4), saturated=est.saturated(), cancelling=est.cancelling())
        if est.grad_drop is not None:
            data["grad_drop"] = est.grad_drop.tolist()
    if est is not None and exact is not None:
        agree = lens.agreement(est.values, exact.values, k=args.top)
        data.update(exact_values=exact.values.tolist(), exact_seconds=round(exact_s, 4),
                    spearman=agree.spearman, recall=agree.recall, k=agree.k)
    if not args.json:
        order = p.values.nan_to_num(0.0).flatten().abs().argsort(descending=True)[: args.top].tolist()
        what = "position" if p.site == "resid" else "head"
        # an estimate's last column is the change it predicts; a sweep's, the metric it got
        last, last_name = ((est.delta, "change of the metric") if est is not None else (p.raw, "metric"))
        exact_col = exact.values.flatten() if agree is not None else None
        gd = est.grad_drop.flatten() if est is not None and est.grad_drop is not None else None
        _table(f"{method} {p.site}: {measured} is {p.clean_diff:.3f} clean, {p.corrupt_diff:.3f} corrupt; "
               "1 = a cell restores it all",
               ["layer", what, "restored", *(["GradDrop"] if gd is not None else []),
                *(["exact"] if exact_col is not None else []), last_name],
               [[str(i // C), _show(cols[i % C]) if p.site == "resid" else cols[i % C],
                 f"{float(p.values.flatten()[i]):.3f}",
                 *([f"{float(gd[i]):.3f}"] if gd is not None else []),
                 *([f"{float(exact_col[i]):.3f}"] if exact_col is not None else []),
                 f"{float(last.flatten()[i]):.3f}"] for i in order])
        if est is not None:
            more = f", {est.ig_steps} more of each" if est.ig_steps else ""
            passes = "two forward passes, one backward" + more
            line = f"estimated in {est.seconds:.2f} s ({passes})"
            if agree is not None:
                line += (f"; the exact sweep took {exact_s:.2f} s: Spearman {agree.spearman:.3f}, "
                         f"top-{agree.k} recall {agree.recall:.2f}")
            else:
                line += "; --compare runs the exact sweep and says how well they agree"
            console().print(line, highlight=False)
            _flags(est)
    _write(out, data, Heatmap(p.values, [f"layer {i}" for i in range(L)], cols,
                              f"{lm.name}: {method} {p.site} from clean into corrupt", None,
                              "share of the clean metric restored", diverging=True))
    return data


def _flags(est) -> None:
    """The estimate's known failures, said where they may apply (Kramár et al. 2024)."""
    sat = est.saturated()
    if sat and est.site in ("query", "key") and not est.qk_fix:
        console().print(f"saturated attention in the corrupt run ({_heads(sat)}): a first-order estimate "
                        "through their queries and keys can miss a large effect; --qk-fix computes it "
                        "exactly", highlight=False)
    elif sat and est.site in ("head", "resid") and not est.ig_steps:
        console().print(f"saturated attention in the corrupt run ({_heads(sat)}): an effect that reaches the "
                        "answer through them can be missed to first order; --ig-steps 8 looks along the way",
                        highlight=False)
    cancel = est.cancelling()
    if cancel:
        console().print(f"cancellation: GradDrop is at least 3x the plain estimate at {_heads(cancel)} "
                        "(direct and indirect effects offsetting each other): rank these by GradDrop",
                        highlight=False)


def _heads(cells: list[tuple[int, int]], most: int = 8) -> str:
    names = ", ".join(f"{a}.{b}" for a, b in cells[:most])
    return names + (f" and {len(cells) - most} more" if len(cells) > most else "")


def _view_edges(lm, text: str, args: argparse.Namespace, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import EdgeGraph

    e = lens.edge_attribution(lm, text, args.corrupt, answer=args.answer, wrong=args.wrong,
                              metric=args.metric, ig_steps=args.ig_steps)
    method = f"EAP-IG ({e.ig_steps} steps)" if e.ig_steps else "EAP"
    top = e.top(args.top)
    measured = e.measured()
    data = {"method": method, "metric": e.metric, "answer": e.answer, "wrong": e.wrong,
            "clean_diff": e.clean_diff, "corrupt_diff": e.corrupt_diff, "seconds": round(e.seconds, 4),
            "edges": [{"sender": t.sender, "receiver": t.receiver, "value": t.value} for t in top],
            "senders": e.senders, "receivers": e.receivers}
    if not args.json:
        n = int((~e.values.isnan()).sum())
        _table(f"{method}: {measured} is {e.clean_diff:.3f} clean, {e.corrupt_diff:.3f} corrupt; the "
               f"{len(top)} strongest of {n} edges (1 = an edge restores it all)",
               ["sender", "receiver", "restored"], [[t.sender, t.receiver, f"{t.value:+.3f}"] for t in top])
        console().print(f"estimated in {e.seconds:.2f} s; a receiver a<layer>.<head>.q|k|v is that head's "
                        "query, key or value input", highlight=False)
    L, H, _ = lens.hooks.shape(lm.model)
    _write(out, data, EdgeGraph([(t.sender, t.receiver, t.value) for t in top], L, H,
                                f"{lm.name}: {method}, the {len(top)} strongest edges",
                                "arrow width: share of the clean metric restored; red +, blue -"))
    return data


def view_attribute(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Bars

    a = lens.attribute(lm, text, args.attribute, args.wrong)
    what = f"logit[{_show(a.answer)}]" + (f" - logit[{_show(a.wrong)}]" if a.wrong is not None else "")
    data = {"answer": a.answer, "wrong": a.wrong, "total": a.total, "note": a.note,
            "parts": dict(zip(a.names, a.values.tolist(), strict=True))}
    order = a.values.abs().argsort(descending=True)[: args.top].tolist()
    if not args.json:
        _table(f"direct logit attribution of {what} = {a.total:.3f} ({a.note}); the {len(order)} "
               "largest parts",
               ["part", "contribution"], [[a.names[i], f"{float(a.values[i]):+.4f}"] for i in order])
    _write(out, data, Bars([a.names[i] for i in order], [float(a.values[i]) for i in order],
                           f"{lm.name}: {what} = {a.total:.3f}, by part",
                           "contribution to the logit difference"))
    return data


def view_qk(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import Bars

    parsed = lens.parse_heads(args.qk)
    if len(parsed) != 1:
        raise ValueError(f"--qk takes one head, LAYER.HEAD; got {args.qk!r}")
    qk = lens.query_key(lm, text, *parsed[0], args.query)
    d = qk.q.numel()
    data = {"layer": qk.layer, "head": qk.head, "query": qk.query, "query_token": qk.query_token,
            "keys": qk.tokens, "dots": qk.dots.tolist(), "scaled": qk.scaled.tolist(),
            "weights": qk.weights.tolist(), "head_dim": d}
    if not args.json:
        order = qk.weights.argsort(descending=True)[: args.top].tolist()
        _table(f"layer {qk.layer} head {qk.head}, query {qk.query} ({_show(qk.query_token)}): weight = "
               f"softmax(q·k / √{d}); the {len(order)} largest",
               ["key", "position", "q·k", "q·k / √d", "weight"],
               [[_show(qk.tokens[j]), str(j), f"{float(qk.dots[j]):.3f}", f"{float(qk.scaled[j]):.3f}",
                 f"{float(qk.weights[j]):.4f}"] for j in order])
    title = f"{lm.name}: layer {qk.layer} head {qk.head}, query {qk.query}: softmax(q·k / √{d})"
    _write(out, data, Bars([f"{_show(t)} #{j}" for j, t in enumerate(qk.tokens)], qk.weights.tolist(),
                           title, "attention weight"))
    return data


def view_rollout(lm, text: str, args: argparse.Namespace, heads, out: Path | None) -> dict[str, Any]:
    from qkv import lens
    from qkv.figures import AttentionMaps

    tokens, r = lens.text_rollout(lm, text)
    data = {"tokens": tokens, "rollout": r.tolist()}
    if not args.json:
        last = r[-1]
        order = last.argsort(descending=True)[: args.top].tolist()
        _table(f"attention rollout: where the last token ({_show(tokens[-1])}) draws from, through all "
               f"{lm.n_layers} layers (residual counted as half of each layer)",
               ["token", "position", "share"],
               [[_show(tokens[j]), str(j), f"{float(last[j]):.4f}"] for j in order])
    title = f"{lm.name}: attention rollout (rows: outputs, columns: inputs)"
    _write(out, data, AttentionMaps(r, tokens, title))
    return data


VIEW_FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "probs": view_probs, "logit_lens": view_logit_lens, "ablate": view_ablate, "effects": view_effects,
    "heads": view_heads, "patch": view_patch, "attribute": view_attribute, "qk": view_qk,
    "rollout": view_rollout,
}
