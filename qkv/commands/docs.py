"""`qkv docs`: build the documentation site offline and serve it on this machine.

The site's sources are ``mkdocs.yml`` and ``docs/`` of a source checkout (as ``qkv bench`` needs
``benchmarks/``). The build goes to a fresh folder beside the target and replaces it only when it
is complete, so a failed or interrupted build never leaves half a site. The server is Python's
own static file server on 127.0.0.1, in this process: Ctrl-C (or the end of the command) stops it
and frees the port; nothing keeps running after the command.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from qkv.errors import InputError
from qkv.fileio import fsync_dir

DEFAULT_PORT = 8001
INSTALL = "pip install -e '.[docs]'"


def checkout_root() -> Path:
    """The source checkout this qkv runs from (where ``mkdocs.yml`` lives)."""
    return Path(__file__).resolve().parents[2]


def _config_file(root: Path) -> Path:
    config = root / "mkdocs.yml"
    if not config.is_file():
        raise InputError(f"no mkdocs.yml in {root}; `qkv docs` needs a source checkout "
                         "(git clone, then pip install -e '.[docs]')")
    return config


def build_site(out: Path, *, root: Path | None = None, strict: bool = False) -> Path:
    """Build the site into ``out`` (replaced whole, only once the build has succeeded).

    Args:
        out: the folder to write; its parent is created.
        root: the source checkout (default: the one this qkv runs from).
        strict: fail on any warning (a broken link, anchor or reference), as CI does.

    Returns:
        ``out``, holding ``index.html``.

    Raises:
        InputError: no ``mkdocs.yml`` in ``root``, or the strict build found a warning.
        ImportError: MkDocs is not installed (the message names the extra to install).
    """
    config_file = _config_file(root or checkout_root())
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
        from mkdocs.exceptions import Abort, ConfigurationError
    except ImportError as e:
        raise ImportError(f"the documentation site needs MkDocs: {INSTALL}") from e
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # a banner about MkDocs' future, not this site
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, not a folder; give another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config = load_config(str(config_file), site_dir=str(tmp), strict=strict)
        try:
            build(config)
        except (Abort, ConfigurationError) as e:
            raise InputError(f"the documentation did not build: {e} (run `mkdocs build --strict` in "
                             f"{config_file.parent} for the details)") from e
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace_dir(new: Path, target: Path) -> None:
    """Put the folder ``new`` where ``target`` is: renames only, the old one removed after."""
    old = None
    if target.exists():
        if not target.is_dir():
            raise InputError(f"{target} is a file, not a folder; give another --out")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class _QuietHandler(SimpleHTTPRequestHandler):
    """Serves the built folder; no line per request on stderr."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def make_server(site: Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> ThreadingHTTPServer:
    """A static file server for the folder ``site`` (read at each request, so it may be built
    after) on ``host:port`` (port 0: any free port), bound but not yet serving: pass it to
    :func:`serve_site`, or call ``server_close`` to free the port."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another port "
                         "with --port") from e


def serve_site(server: ThreadingHTTPServer, *, open_browser: bool = False,
               on_ready: Callable[[str], None] = print, stop: threading.Event | None = None) -> None:
    """Serve with ``server`` (from :func:`make_server`) until Ctrl-C, or until ``stop`` is set;
    then shut it down and close its port, whatever ended it."""
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/"
    thread = threading.Thread(target=server.serve_forever, name="qkv-docs", daemon=True)
    thread.start()
    try:
        on_ready(url)
        if open_browser:
            import webbrowser

            webbrowser.open(url)
        (stop or threading.Event()).wait()  # an Event never set: until Ctrl-C
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return port


def cmd_docs(args: argparse.Namespace) -> int:
    """Build the site, then serve it (unless --no-serve). The port is taken before the build, so
    a port in use is said at once."""
    out = Path(args.out) if args.out else checkout_root() / "build" / "docs"
    server = None if args.no_serve else make_server(out, args.host, args.port)
    try:
        print(f"building the documentation into {out} ...", flush=True)
        site = build_site(out, strict=args.strict)
    except BaseException:
        if server is not None:
            server.server_close()
        raise
    if server is None:
        print(f"open {site / 'index.html'} in a browser (or run `qkv docs` to serve it)")
        return 0

    def ready(url: str) -> None:
        print(f"serving the documentation at {url} (Ctrl-C stops it)", flush=True)

    serve_site(server, open_browser=args.open, on_ready=ready)
    return 0


def add_docs_parser(sub) -> None:
    p = sub.add_parser(
        "docs",
        help="build the documentation site offline and serve it locally",
        description="Build the documentation site (mkdocs.yml and docs/ of this source checkout) "
        "into a folder, offline, and serve it on this machine until Ctrl-C. Needs the docs extra: "
        f"{INSTALL}.",
    )
    p.add_argument("-o", "--out", metavar="DIR",
                   help="where to build the site (default: build/docs in the checkout; replaced whole)")
    p.add_argument("--no-serve", action="store_true", help="only build it; print the folder")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help="the port to serve on (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument("--open", action="store_true", help="open the site in a web browser once it is served")
    p.add_argument("--strict", action="store_true",
                   help="fail on any broken link, anchor or reference (as CI's `mkdocs build --strict`)")
    p.set_defaults(func=cmd_docs)
