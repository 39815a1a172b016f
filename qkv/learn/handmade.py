"""Exercises (being written)."""

from __future__ import annotations

from qkv.learn.exercise import Exercise

HANDMADE: tuple[Exercise, ...] = ()
