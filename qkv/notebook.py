"""`qkv.show(model, text)`: the lens's views inline in a Jupyter notebook, offline.

    import qkv
    lm = qkv.load("smollm2")
    qkv.show(lm, "The capital of France is")                 # bars, logit lens, head scores
    qkv.show(lm, "...", views=("probs", "attention"), layer=3)
    lm32 = qkv.load("smollm2", weights="fp32")                # the estimate needs gradients
    qkv.show(lm32, clean, views=["patch"], corrupt=other)     # which heads matter, estimated
    qkv.show(lm32, clean, views=["patch"], corrupt=other, compare=True)  # beside the exact sweep

The object renders itself as HTML (``_repr_html_``) holding standalone SVG pictures drawn by
:mod:`qkv.viz` from :mod:`qkv.lens`'s numbers (the same figures `qkv lens -o x.svg` writes): no
JavaScript, nothing fetched from anywhere, so it shows behind a firewall, in a static export of
the notebook and on GitHub. ``.svg(view)`` gives one picture's SVG text; ``.save(folder)`` writes
them all.
"""

from __future__ import annotations

import html
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkv.errors import InputError

VIEWS = ("probs", "logit_lens", "heads", "attention", "patch")
RESTORED = "share of the clean logit difference restored"  # the patch view's colour bar


def _svg(figure: Any) -> str:
    from qkv.viz import draw

    with tempfile.TemporaryDirectory() as tmp:
        path = draw(figure, Path(tmp) / "view.svg")
        text = path.read_text(encoding="utf-8")
    return text[text.index("<svg"):]  # without the XML prolog and DOCTYPE: inline HTML


@dataclass
class Shown:
    """The views of one text as SVG text, by name ("probs", "logit_lens", "heads", "attention",
    "patch"), and the figures (:mod:`qkv.figures`: the numbers) they were drawn from."""

    title: str
    pictures: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    def svg(self, view: str) -> str:
        if view not in self.pictures:
            raise KeyError(f"no view {view!r}; these were drawn: {', '.join(self.pictures)}")
        return self.pictures[view]

    def save(self, folder: str | Path) -> list[Path]:
        """Write each view as ``folder/VIEW.svg``; returns the paths."""
        from qkv.fileio import atomic_write

        out = []
        for name, svg in self.pictures.items():
            path = Path(folder) / f"{name}.svg"
            atomic_write(path, lambda p, svg=svg: p.write_text(svg, encoding="utf-8"))
            out.append(path)
        return out

    def _repr_html_(self) -> str:
        parts = [f"<div class='qkv-show'><p><b>{html.escape(self.title)}</b></p>"]
        for name, svg in self.pictures.items():
            parts.append(f"<figure style='display:inline-block;margin:4px;vertical-align:top'>{svg}"
                         f"<figcaption>{html.escape(name)}</figcaption></figure>")
        return "".join(parts) + "</div>"


def _patch_figure(lm: Any, clean: str, corrupt: str, site: str, answer: str | None, wrong: str | None,
                  compare: bool) -> Any:
    """The patch view: attribution patching's (L, H) or (L, T) table as a heatmap
    (:func:`qkv.lens.attribution_patch`); with ``compare``, the exact sweep's beside it
    (:func:`qkv.lens.patch`) and their agreement (:func:`qkv.lens.agreement`) in the title."""
    from qkv import lens
    from qkv.figures import Heatmap, Heatmaps

    if getattr(lm, "weights", None) in ("int8", "q4"):
        raise InputError(f"the patch view's estimate needs gradients, which {lm.name}'s {lm.weights} weights "
                         "do not have: load it with float weights, qkv.load(..., weights='fp32')")
    est = lens.attribution_patch(lm, clean, corrupt, site=site, answer=answer, wrong=wrong)
    L, C = est.values.shape
    rows = [f"layer {i}" for i in range(L)]
    cols = est.clean_tokens if site == "resid" else [str(h) for h in range(C)]
    what = f"logit[{est.answer!r}] - logit[{est.wrong!r}], {site}"
    if not compare:
        title = f"attribution patching ({what}): estimated in {est.seconds:.2f} s"
        return Heatmap(est.values, rows, cols, title, None, RESTORED, diverging=True)
    exact = lens.patch(lm, clean, corrupt, site=site, answer=answer, wrong=wrong)
    a = lens.agreement(est.values, exact.values)
    return Heatmaps([Heatmap(est.values, rows, cols, "estimate (attribution patching)", None, RESTORED, True),
                     Heatmap(exact.values, rows, cols, "exact (activation patching)", None, RESTORED, True)],
                    f"{what}: Spearman {a.spearman:.3f}, top-{a.k} recall {a.recall:.2f}")


def show(lm: Any, text: str, views: Sequence[str] | None = None, temperature: float = 1.0, k: int = 10,
         layer: int | None = None, corrupt: str | None = None, compare: bool = False, site: str = "head",
         answer: str | None = None, wrong: str | None = None) -> Shown:
    """Draw ``views`` of ``lm`` reading ``text`` (default: next-token bars, the logit lens and
    the head scores for a decoder; the head scores and the attention of ``layer`` for an
    encoder; and the patch view when ``corrupt`` is given).

    The "patch" view (decoders) patches ``text`` (clean) into ``corrupt`` (the same number of
    tokens): attribution patching's estimate of every cell of ``site`` ("head": layer x head;
    "resid": layer x position), 0 = as corrupt, 1 = as clean, towards ``answer`` against
    ``wrong`` (defaults: each prompt's top token); ``compare``: the exact sweep beside it, with
    how well the two agree (Spearman, top-10 recall) in the title. The estimate needs float
    weights (``qkv.load(name, weights="fp32")``)."""
    from qkv import lens
    from qkv.figures import AttentionMaps, Bars, Heatmap, Heatmaps
    from qkv.pipelines import check_layer_head
    from qkv.pipelines.attention import text_attention

    decoder = getattr(lm, "kind", None) == "decoder"
    if getattr(lm, "kind", None) not in ("decoder", "encoder"):
        raise InputError("qkv.show draws text models (decoders and encoders); use qkv.viz for other kinds")
    if views is None:
        views = (("probs", "logit_lens", "heads") if decoder else ("heads", "attention")) + \
            (("patch",) if corrupt is not None else ())
    views = tuple(views)
    bad = [v for v in views if v not in VIEWS]
    if bad:
        raise InputError(f"unknown view {bad[0]!r}; choose from {', '.join(VIEWS)}")
    if "patch" in views and corrupt is None:
        raise InputError("the patch view patches text into a corrupt prompt: give corrupt='...' (the same "
                         "number of tokens, one word changed)")
    if "patch" not in views and (corrupt is not None or compare):
        raise InputError("corrupt= and compare= are the patch view's: add 'patch' to views")
    shown = Shown(f"{lm.name}: {text[:80]}")
    cache = lens.run_with_cache(lm, text) if {"probs", "logit_lens"} & set(views) else None
    for view in views:
        if view == "probs":
            nt = lens.next_token(lm, cache, temperature=temperature, k=k)
            figure: Any = Bars([p.token for p in nt.top], [p.prob for p in nt.top],
                               f"next token (T = {temperature:g})", "probability")
        elif view == "logit_lens":
            ll = lens.logit_lens(lm, cache)
            probs, ids = ll.top(1)
            cells = [[lm.tokenizer.decode([int(i)]) for i in row] for row in ids[..., 0]]
            figure = Heatmap(probs[..., 0], ll.rows, ll.tokens, "logit lens: each layer's top token", cells,
                             "probability")
        elif view == "heads":
            sc = lens.head_scores(lm)
            rows = [f"layer {i}" for i in range(sc.previous.shape[0])]
            cols = [str(h) for h in range(sc.previous.shape[1])]
            figure = Heatmaps([Heatmap(s, rows, cols, t, None, "score") for t, s in sc.by_type().items()],
                              "head scores on repeated random tokens")
        elif view == "patch":
            assert corrupt is not None
            figure = _patch_figure(lm, text, corrupt, site, answer, wrong, compare)
        else:
            att = text_attention(lm, text)
            chosen, _ = check_layer_head(lm.n_layers, lm.n_heads, layer, None)
            figure = AttentionMaps(att.weights[chosen], att.tokens, f"layer {chosen}: every head")
        shown.figures[view] = figure
        shown.pictures[view] = _svg(figure)
    return shown
