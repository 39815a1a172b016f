"""The ``qkv`` command line: one entry point, thin subcommands.

Every failure a user can cause ends in one line on stderr naming the problem and the fix,
exit code 2, no traceback (DESIGN.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from qkv.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where the options are listed, no usage
    block (every subcommand's parser is of this class too)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qkv",
        description="Attention and Transformers from first principles. "
        "`python -m qkv` works the same.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")


    from qkv.commands.assets import add_assets_parser
    from qkv.commands.attend import add_attend_parser
    from qkv.commands.bench import add_bench_parser
    from qkv.commands.caption import add_caption_parser
    from qkv.commands.docs import add_docs_parser
    from qkv.commands.explain import add_explain_parser
    from qkv.commands.export import add_export_parser
    from qkv.commands.generate import add_generate_parser
    from qkv.commands.learn import add_learn_parser
    from qkv.commands.lens import add_lens_parser
    from qkv.commands.prepare import add_prepare_parser
    from qkv.commands.pretrained import add_embed_parser, add_similarity_parser
    from qkv.commands.seq2seq import add_translate_parser
    from qkv.commands.serve import add_serve_parser
    from qkv.commands.train import add_train_parser
    from qkv.commands.vision import add_classify_parser

    add_bench_parser(sub)
    add_train_parser(sub)
    add_generate_parser(sub)
    add_prepare_parser(sub)
    add_embed_parser(sub)
    add_similarity_parser(sub)
    add_classify_parser(sub)
    add_translate_parser(sub)
    add_caption_parser(sub)
    add_attend_parser(sub)
    add_lens_parser(sub)
    add_explain_parser(sub)
    add_learn_parser(sub)
    add_export_parser(sub)
    add_serve_parser(sub)
    add_assets_parser(sub)
    add_docs_parser(sub)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["learn", "check"] and not {"-h", "--help"} & set(argv):
        from qkv.learn import launch  # no torch: the child imports it while this process does

        launch.ahead()
    from qkv.commands.train import default_family

    parser = build_parser()
    from qkv.commands.generate import bare_compile

    argv = bare_compile(default_family(argv))
    # parse_known_args: argparse cannot put a `nargs="*"` positional after options
    # (`qkv embed minilm --json "a b"`); commands that take free text collect the rest.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "extra_texts", False) and not any(e.startswith("-") for e in extra):
            args.texts = [*args.texts, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    _one_line_warnings()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        kind = _user_error_kind(e)
        if kind is None or os.environ.get("QKV_DEBUG"):
            raise
        print(f"qkv: {kind}: {_one_line(e)}", file=sys.stderr)
        return 130 if kind == "interrupted" else 2


def _one_line_warnings() -> None:
    """qkv's own warnings (a GGUF split qkv does not know, ...) as one line, ``qkv: warning: ...``;
    other libraries' keep Python's usual form."""
    import warnings

    package = os.path.dirname(os.path.abspath(__file__))
    default = warnings.showwarning
    if getattr(default, "qkv_one_line", False):  # main() called again in this process
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package + os.sep):
            print(f"qkv: warning: {_one_line(Warning(str(message)))}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show.qkv_one_line = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _user_error_kind(e: Exception) -> str | None:
    """Errors a user can cause and fix: printed as one line (exit 2), no traceback.

    QKV_DEBUG=1 shows the traceback instead.
    """
    from qkv.assets import AssetInstallError, AssetMissingError
    from qkv.training.checkpoint import CheckpointError
    from qkv.training.trainer import TrainingDivergedError, TrainingInterruptedError

    if isinstance(e, TrainingInterruptedError):
        return "interrupted"
    if isinstance(e, (ValueError, AssetMissingError, AssetInstallError, CheckpointError,
                      TrainingDivergedError)):
        return "error"
    if isinstance(e, OSError):  # a path given that is not a folder, a full disk, no permission...
        return "error"
    if isinstance(e, ImportError):
        return "missing dependency"
    return None


if __name__ == "__main__":
    sys.exit(main())
