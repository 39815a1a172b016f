"""Subcommand implementations behind `qkv` (thin: parse, call the library, print)."""
