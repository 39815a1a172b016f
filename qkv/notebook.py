"""`qkv.show(model, text)`: the lens's views inline in a Jupyter notebook, offline.

    import qkv
    lm = qkv.load("smollm2")
    qkv.show(lm, "The capital of France is")                 # bars, logit lens, head scores
    qkv.show(lm, "...", views=("probs", "attention"), layer=3)

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

VIEWS = ("probs", "logit_lens", "heads", "attention")


def _svg(figure: Any) -> str:
    from qkv.viz import draw

    with tempfile.TemporaryDirectory() as tmp:
        path = draw(figure, Path(tmp) / "view.svg")
        text = path.read_text(encoding="utf-8")
    return text[text.index("<svg"):]  # without the XML prolog and DOCTYPE: inline HTML


@dataclass
class Shown:
    """The views of one text as SVG text, by name ("probs", "logit_lens", "heads", "attention")."""

    title: str
    pictures: dict[str, str] = field(default_factory=dict)

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


def show(lm: Any, text: str, views: Sequence[str] | None = None, temperature: float = 1.0, k: int = 10,
         layer: int | None = None) -> Shown:
    """Draw ``views`` of ``lm`` reading ``text`` (default: next-token bars, the logit lens and
    the head scores for a decoder; the head scores and the attention of ``layer`` for an
    encoder)."""
    from qkv import lens
    from qkv.figures import AttentionMaps, Bars, Heatmap, Heatmaps
    from qkv.pipelines import check_layer_head
    from qkv.pipelines.attention import text_attention

    decoder = getattr(lm, "kind", None) == "decoder"
    if getattr(lm, "kind", None) not in ("decoder", "encoder"):
        raise InputError("qkv.show draws text models (decoders and encoders); use qkv.viz for other kinds")
    views = tuple(views) if views is not None else (("probs", "logit_lens", "heads") if decoder
                                                    else ("heads", "attention"))
    bad = [v for v in views if v not in VIEWS]
    if bad:
        raise InputError(f"unknown view {bad[0]!r}; choose from {', '.join(VIEWS)}")
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
        else:
            att = text_attention(lm, text)
            chosen, _ = check_layer_head(lm.n_layers, lm.n_heads, layer, None)
            figure = AttentionMaps(att.weights[chosen], att.tokens, f"layer {chosen}: every head")
        shown.pictures[view] = _svg(figure)
    return shown
