"""What an exercise is, and the pieces its checks are made of.

An :class:`Exercise` names the function a student writes (its name and signature), the lecture
section it belongs to, a stub (the docstring with the lecture's formula, shapes, conventions,
what not to call, a worked example), progressive hints, where to see the idea in qkv, and its
checks: small functions of the student's function that return None (passed) or a message that
teaches (the smallest failing input, expected vs got, and the likely cause when it is
recognisable). The references the checks compare with are PyTorch's own ops and float64 formulas
written in the check, never the student's function and never qkv's implementation under test.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

CheckFn = Callable[[Callable[..., Any]], "str | None"]


@dataclass(frozen=True)
class Check:
    """One check: its name (what it checks, in words) and the function that runs it;
    ``forbids``: for a "does not call X" check, the names (the grader judges those from what the
    child saw called and from the source, not by running ``run``)."""

    name: str
    run: CheckFn
    forbids: tuple[str, ...] = ()


class Shown(str):
    """What a check returns when it passed and has something to show (a prediction exercise's
    reveal: the numbers the prediction was about); any other string a check returns is the
    message of a failure."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``ok`` and, when it failed, the message that says why; ``note``:
    what a passing check shows (:class:`Shown`)."""

    name: str
    ok: bool
    message: str = ""
    note: str = ""

    @classmethod
    def of(cls, name: str, said: str | None) -> CheckResult:
        """The result of a check that said ``said``: None (passed), a :class:`Shown` (passed, with
        something to show) or a message (failed)."""
        if isinstance(said, Shown):
            return cls(name, True, "", str(said))
        return cls(name, said is None, said or "")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "ok": self.ok, "message": self.message}
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Report:
    """Every check of one exercise on one solution. ``error``: why no check (or not every check)
    could run; ``status``: "" (checked), "unwritten" (the stub, untouched: no check counted),
    "refused" (the file imports qkv: 0) or "error" (it raised, timed out, ...); ``notes``: what
    the grader could not isolate (said in the grade output)."""

    exercise: str
    checks: tuple[CheckResult, ...]
    error: str = ""  # why no check could run (the file raised, timed out, ...): then passed is False
    status: str = ""
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.checks) and all(c.ok for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"passed": self.passed, "checks": [c.as_dict() for c in self.checks]}
        if self.error:
            out["error"] = self.error
        if self.status:
            out["status"] = self.status
        return out

    def text(self) -> str:
        """The report as a student reads it: one line per check, a verdict last."""
        if self.status == "unwritten":
            return f"{self.exercise}: {self.error}"
        lines = [f"{self.exercise}:"]
        if self.error:
            lines.append(f"  FAIL  {self.error}")
        for c in self.checks:
            said = f"\n        {c.note}" if c.ok and c.note else "" if c.ok else f"\n        {c.message}"
            lines.append(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}" + said)
        n = sum(c.ok for c in self.checks)
        lines.append(f"{n}/{len(self.checks)} checks pass" + (": well done" if self.passed else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class Exercise:
    """One function to write. ``section``: the lecture section's title as in
    :data:`qkv.explain.lectures.LECTURES`; ``difficulty``: 1 (warm-up) to 3; ``forbidden``: calls
    its solution may not make (by attribute or function name); ``see``: where qkv shows it."""

    name: str
    section: str
    difficulty: int
    signature: str
    stub: str
    checks: tuple[Check, ...]
    hints: tuple[str, ...]
    see: str
    forbidden: tuple[str, ...] = ()
    solution: str = field(default="", repr=False)  # a reference solution, for tests and graders only

    def stub_file(self) -> str:
        """The file ``qkv learn start`` writes: the function with its docstring and a body to fill."""
        doc = "\n".join(("    " + line) if line else "" for line in self.stub.strip("\n").splitlines())
        return (
            f'"""qkv exercise: {self.name} ({self.section}).\n\nCheck it with `qkv learn check '
            f'{self.name}`; a hint: `qkv learn hint {self.name}`."""\n\nimport math\n\nimport torch\n\n\n'
            f'def {self.name}{self.signature}:\n    """\n{doc}\n    """\n'
            f'    raise NotImplementedError("write {self.name}")\n'
        )


# --------------------------------------------------------------------------- check helpers


_SEED_OFFSET = [0]


@contextmanager
def other_inputs(offset: int) -> Iterator[None]:
    """Within this block every check draws other random inputs (their seeds moved by ``offset``):
    a course's grader runs the same checks on inputs its students never saw."""
    before = _SEED_OFFSET[0]
    _SEED_OFFSET[0] = offset
    try:
        yield
    finally:
        _SEED_OFFSET[0] = before


def gen(seed: int) -> torch.Generator:
    """The generator every check draws its random inputs from (see :func:`other_inputs`)."""
    return torch.Generator().manual_seed(seed + _SEED_OFFSET[0])


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64).to(dtype)


def show(t: Any, digits: int = 4) -> str:
    """A small tensor as a student reads it (rounded, at most a few dozen numbers)."""
    if not isinstance(t, Tensor):
        return repr(t)
    if t.dtype == torch.bool:
        return str(t.int().tolist())
    flat = t.detach().double()
    if flat.numel() > 24:
        first = [round(v, digits) for v in flat.flatten()[:6].tolist()]
        return f"tensor of shape {tuple(t.shape)}, first values {first}"
    return str(torch.round(flat, decimals=digits).tolist())


def as_tensor(got: Any, what: str) -> Tensor:
    if not isinstance(got, Tensor):
        raise CheckError(f"{what} should be a torch.Tensor, got {type(got).__name__}")
    return got


def pair(got: Any, what: str, names: str = "(out, weights)") -> tuple[Any, Any]:
    """The two results of a function that returns a pair (CheckError naming ``names`` otherwise)."""
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise CheckError(f"{what} should return a pair {names}, got {type(got).__name__}")
    return got[0], got[1]


class CheckError(Exception):
    """Raised inside a check with the message the student reads."""


# The tolerances a correct answer in each dtype meets against a float64 reference (the default
# of close(): no correct float32 answer fails at 1e-5; a check may pass its own).
TOLERANCE = {torch.float64: (1e-7, 1e-10), torch.float32: (2e-5, 1e-6),
             torch.bfloat16: (2e-2, 1e-3), torch.float16: (5e-3, 1e-4)}


def close(
    got: Any,
    want: Tensor,
    what: str,
    inputs: str,
    rtol: float | None = None,
    atol: float | None = None,
    causes: Sequence[tuple[Tensor, str]] = (),
) -> None:
    """CheckError unless ``got`` equals ``want`` (shape, dtype and values to ``rtol``/``atol``,
    by default :data:`TOLERANCE` of ``want``'s dtype; CS231N's relative error); ``causes``:
    (what a common mistake gives, its diagnosis), said when ``got`` matches it; otherwise a
    generic diagnosis (:func:`diagnose`) when one fits, then expected vs got."""
    got = as_tensor(got, what)
    default_rtol, default_atol = TOLERANCE.get(want.dtype, (1e-6, 1e-8))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    if want.dtype != torch.float64:  # below float64, never tighter than the dtype's own rounding allows
        rtol, atol = max(rtol, default_rtol), max(atol, default_atol)
    if tuple(got.shape) != tuple(want.shape):
        why = ""
        if got.ndim >= 2 and tuple(got.shape) == tuple(want.transpose(-1, -2).shape):
            why = ": the last two dimensions are swapped (a transpose too many or too few?)"
        raise CheckError(
            f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} for {inputs}{why}")
    if got.dtype != want.dtype:
        raise CheckError(f"{what} has dtype {got.dtype}, expected {want.dtype} (the input's) for {inputs}")
    g, w = got.detach().double(), want.double()
    if torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
        return
    for mistake, why in causes:
        if tuple(mistake.shape) == tuple(g.shape) and torch.allclose(
            g, mistake.double(), rtol=1e-4, atol=1e-6
        ):
            raise CheckError(f"{what} for {inputs}: expected {show(want)}, got {show(got)}: {why}")
    general = diagnose(g, w)
    err = ((g - w).abs() / (g.abs() + w.abs()).clamp_min(1e-12)).nan_to_num(1.0).max().item()
    if g.numel() <= 24:
        raise CheckError(f"{what} for {inputs}: {general + '; ' if general else ''}expected {show(want)}, "
                         f"got {show(got)} (relative error {err:.1e})")
    raise CheckError(f"{what} for {inputs}: {general + '; ' if general else ''}"
                     f"{first_difference(g, w, rtol, atol)} (largest relative error {err:.1e})")


def first_difference(g: Tensor, w: Tensor, rtol: float, atol: float) -> str:
    """The first index where ``g`` and ``w`` differ, with its neighbours along the last dimension."""
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    lo = max(0, idx[-1] - 2)
    hi = min(g.shape[-1], idx[-1] + 3) if g.ndim else 1
    row = idx[:-1]
    near_g = [round(v, 4) for v in g[row][lo:hi].tolist()] if g.ndim else [round(g.item(), 4)]
    near_w = [round(v, 4) for v in w[row][lo:hi].tolist()] if w.ndim else [round(w.item(), 4)]
    return (f"first difference at index {list(idx)} (of shape {tuple(g.shape)}): there, positions "
            f"{lo}..{hi - 1} of the last dimension are {near_g}, expected {near_w}")


def _factor_name(c: float) -> str:
    """A constant factor, named when it is a common one (2, 1/2, √d, 1/√d, d)."""
    for d in (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        for value, name in ((math.sqrt(d), f"√{d}"), (1 / math.sqrt(d), f"1/√{d}"), (float(d), f"{d}"),
                            (1 / d, f"1/{d}")):
            if abs(c - value) <= 1e-3 * abs(value):
                return f" (= {name})"
    return ""


def diagnose(g: Tensor, w: Tensor) -> str:
    """A generic reason why ``g`` (got) is not ``w`` (wanted, same shape, float64), or "": a
    NaN or inf, the transpose, probabilities that are negative, do not sum to 1 or are normalised
    over another dimension, or the answer times a constant (√d, 2, ...)."""
    finite_w = torch.isfinite(w)
    odd = ~torch.isfinite(g) & finite_w
    if odd.any():
        idx = [int(i) for i in odd.nonzero()[0]]
        kind = "NaN" if torch.isnan(g[tuple(idx)]) else "inf"
        return f"it has {kind} at index {idx} ({int(odd.sum())} of {g.numel()} values; expected finite ones)"
    if not g.any() and w.any():
        return "it is all zeros"
    if g.ndim >= 2 and g.shape[-1] == g.shape[-2] and g.shape[-1] > 1 and torch.allclose(
            g, w.transpose(-1, -2), rtol=1e-5, atol=1e-7):
        return "it is the transpose of the answer (the last two dimensions swapped)"
    if g.ndim >= 1 and finite_w.all() and (w >= -1e-12).all() and g.shape[-1] > 1 and torch.allclose(
            w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5):
        # the answer is a distribution along the last dimension
        if (g < -1e-9).any():
            return f"it has negative probabilities (down to {g.min().item():.3g}): weights come from softmax"
        rows = g.sum(-1)
        if not torch.allclose(rows, torch.ones_like(rows), atol=1e-4):
            for d in range(g.ndim - 1):
                s = g.sum(d)
                if torch.allclose(s, torch.ones_like(s), atol=1e-4):
                    return (f"it is normalised along dim {d}: each row (the last dimension) should sum to 1, "
                            f"yours sum to {[round(v, 3) for v in rows.flatten()[:4].tolist()]}...")
            sums = [round(v, 3) for v in rows.flatten()[:4].tolist()]
            return f"its rows should sum to 1; they sum to {sums}"
    big = w.abs() > 1e-6 * w.abs().max().clamp_min(1e-300)
    if big.sum() >= 2 and finite_w.all():
        r = g[big] / w[big]
        c = r.mean().item()
        if abs(c - 1) > 1e-3 and abs(c) > 1e-6 and r.std().item() <= 1e-5 * abs(c):
            return f"it is {c:.4g}{_factor_name(c)} times the answer (a scale applied twice, or missing?)"
    return ""


def calls(fn: Callable[..., Any]) -> set[str]:
    """The names of library functions ``fn``'s source calls: every ``a.b(...)`` by its attribute
    ``b``, and a bare ``b(...)`` when ``b`` is bound to something of PyTorch's (imported from it);
    the student's own functions (their ``scaled_dot_product_attention`` inside their multi-head
    attention) are not counted. Empty when the source is not available."""
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    scope = getattr(fn, "__globals__", {})
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute):
                out.add(f.attr)
            elif isinstance(f, ast.Name):
                bound = scope.get(f.id)
                if bound is not None and str(getattr(bound, "__module__", "")).startswith("torch"):
                    out.add(f.id)
    return out


def forbid(*names: str) -> Check:
    """A check that the solution does not call any of ``names`` (the thing it is to write)."""

    def run(fn: Callable[..., Any]) -> str | None:
        used = sorted(calls(fn) & set(names))
        if used:
            return f"it calls {', '.join(used)}: the exercise is to write that yourself"
        return None

    return Check(f"does not call {', '.join(names)}", run, tuple(names))


def check(name: str) -> Callable[[CheckFn], Check]:
    """Decorator: a function of the student's function raising CheckError -> a :class:`Check`;
    a string it returns (having passed) is shown beside the pass (:class:`Shown`)."""

    def wrap(fn: Callable[[Callable[..., Any]], str | None]) -> Check:
        def run(student: Callable[..., Any]) -> str | None:
            try:
                shown = fn(student)
            except CheckError as e:
                return str(e)
            return Shown(shown) if isinstance(shown, str) else None

        return Check(name, run)  # type: ignore[arg-type]

    return wrap  # type: ignore[return-value]


def gradcheck(fn: Callable[..., Any], inputs: tuple[Tensor, ...], what: str) -> None:
    """CheckError unless ``fn``'s gradients in float64 match finite differences."""
    ins = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    try:
        ok = torch.autograd.gradcheck(lambda *a: fn(*a), ins, eps=1e-6, atol=1e-5, raise_exception=False)
    except NotImplementedError:
        raise
    except RuntimeError as e:
        raise CheckError(
            f"{what}: autograd cannot differentiate it ({' '.join(str(e).split())[:160]}); "
            "use torch operations on the inputs, not .item(), numpy or in-place tricks"
        ) from None
    if not ok:
        raise CheckError(
            f"{what}: its gradients do not match finite differences (torch.autograd.gradcheck in float64)"
        )
