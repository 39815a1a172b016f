"""Exercises (being written)."""

from __future__ import annotations

from qkv.learn.exercise import Exercise

LEC22: tuple[Exercise, ...] = ()
