"""Exercises (being written)."""

from __future__ import annotations

from qkv.learn.exercise import Exercise

CS231N: tuple[Exercise, ...] = ()
