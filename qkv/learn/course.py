"""(being written)"""

from __future__ import annotations

import argparse

from qkv.errors import InputError


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--course")


def export_main(args: argparse.Namespace) -> int:
    raise InputError("not written yet")


def add_grade_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("submissions", nargs="?")


def grade_main(args: argparse.Namespace) -> int:
    raise InputError("not written yet")
