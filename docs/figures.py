"""Draw the documentation's figures with qkv itself: ``python docs/figures.py`` -> ``docs/img/*.png``.

Every picture is made by a qkv command exactly as a reader types it (``qkv explain TOPIC --plot``,
``qkv attend``, ``qkv lens``), through :func:`qkv.cli.main` in this process, so the figures in
the documentation are the ones the commands draw today. Topics that need an asset (MiniLM for
``context`` and ``attend minilm``, SmolLM2 for ``attend smollm2`` and ``lens``) are skipped with
the command that installs it. The whole run took 45 s on 2 cores of a Zen 4 shared with other work
(``--only NAME`` draws one). The other pictures in ``docs/`` come from the benchmarks
(``bottleneck.png``, ``length_extrapolation.png``, ``norm_placement.png``, ``block_ablation.png``)
and from ``benchmarks/lens_page.py --screens docs`` (``lens-*.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

IMG = Path(__file__).resolve().parent / "img"
IT = "The animal didn't cross the street because it was too tired."


@dataclass(frozen=True)
class Figure:
    """One picture: its file under docs/img/, the qkv command that draws it, the asset it needs."""

    name: str
    argv: tuple[str, ...]
    asset: str | None = None

    def command(self, out: Path) -> list[str]:
        """The command's arguments after ``qkv``, writing to ``out``."""
        return [a.replace("{out}", str(out)) for a in self.argv]


FIGURES: tuple[Figure, ...] = (
    Figure("softmax.png", ("explain", "softmax", "--plot", "{out}")),
    Figure("lookup.png", ("explain", "lookup", "--plot", "{out}")),
    Figure("retrieval.png", ("explain", "retrieval", "--no-minilm", "--plot", "{out}")),
    Figure("scaling.png", ("explain", "scaling", "--plot", "{out}")),
    Figure("worked-example.png", ("explain", "worked-example", "--plot", "{out}")),
    Figure("positions.png", ("explain", "positions", "--plot", "{out}")),
    Figure("cost.png", ("explain", "cost", "--plot", "{out}")),
    Figure("context.png", ("explain", "context", "--plot", "{out}"), "minilm"),
    Figure("attend-minilm-it.png", ("attend", "minilm", IT, "--layer", "2", "-o", "{out}"), "minilm"),
    Figure("attend-smollm2-heads.png", ("attend", "smollm2", "The cat sat on the mat because it was warm.",
                                        "--layer", "3", "-o", "{out}"), "smollm2"),
    Figure("logit-lens.png", ("lens", "smollm2", "--prompt", "The capital of France is",
                                   "--logit-lens", "-o", "{out}"), "smollm2"),
)


def draw(fig: Figure) -> tuple[str, float]:
    """Draw one figure; returns what happened and the seconds it took."""
    from qkv import assets, cli

    if fig.asset is not None and not assets.is_installed(fig.asset):
        return f"skipped: needs `qkv assets install {fig.asset}`", 0.0
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the command's tables: not this script's output
        rc = cli.main(fig.command(IMG / fig.name))
    took = time.perf_counter() - t0
    return ("written" if rc == 0 else f"failed (exit {rc})"), took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", metavar="NAME", help="draw only these (e.g. softmax.png)")
    args = parser.parse_args(argv)
    chosen = [f for f in FIGURES if not args.only or f.name in args.only]
    if not chosen:
        parser.error(f"no figure named {args.only}; choose from {', '.join(f.name for f in FIGURES)}")
    IMG.mkdir(parents=True, exist_ok=True)
    failed = 0
    start = time.perf_counter()
    for fig in chosen:
        what, took = draw(fig)
        failed += what.startswith("failed")
        shown = shlex.join(["qkv", *fig.command(Path("docs/img") / fig.name)])
        print(f"{fig.name:28} {what} ({took:.1f} s): {shown}", flush=True)
    print(f"{len(chosen)} figures in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
