"""(being written)"""

from __future__ import annotations

import argparse

from qkv.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?")


def main(args: argparse.Namespace) -> int:
    raise InputError("not written yet")
