"""`qkv learn`: write the lectures' mechanisms yourself, and have them checked."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from qkv.learn import DEFAULT_DIR


def add_learn_parser(sub) -> None:
    p = sub.add_parser(
        "learn",
        help="exercises: write softmax, attention, masks, heads, positions yourself, and have them checked",
        description="Learn by doing. Each exercise is one function of the lectures (47, at least one for "
        "every section of `qkv explain --lectures` that has a command: softmax, attention in its forms, "
        "masks, heads, positions, LayerNorm, the block, the KV cache, RNN cells, REINFORCE, sampling, a "
        "ViT's patches, and five models whose weights you set by hand), with a stub that gives the "
        "formula, the shapes, what not to call and an example, checks that compare it with an "
        "independent reference and try the edge cases a careless solution breaks, and hints. The "
        "workflow: `qkv learn` (the list, by lecture section), `qkv learn start NAME` (writes "
        "./qkv-exercises/NAME.py), edit it, `qkv learn check NAME` (exit 0 when every check passes, 1 "
        "when some fail, 2 for a bad file), `qkv learn hint NAME` when stuck, `qkv learn run NAME` to "
        "see it inside a real model beside qkv's own, `qkv learn progress`. Your file runs in a process "
        "of its own with a time and memory limit. Also: `qkv learn quiz` (predict, then reveal), `qkv "
        "learn notebook LECTURE`, and for teachers `qkv learn export`/`grade` (docs/courses.md). In a "
        "notebook: `from qkv.learn import check; check('softmax', my_softmax)`.",
    )
    sp = p.add_subparsers(dest="action", metavar="ACTION")
    ls = sp.add_parser("list", help="the exercises, by lecture section, with your progress")
    ls.add_argument("--json", action="store_true", help="a JSON list of {name, section, status, ...}")
    st = sp.add_parser("start", help="write the exercise's stub to DIR/NAME.py (never overwrites)")
    st.add_argument("name")
    st.add_argument("--dir", default=DEFAULT_DIR, help="where to write it")
    ck = sp.add_parser("check", help="run the exercise's checks on your function")
    ck.add_argument("name")
    ck.add_argument("file", nargs="?", default=None, help=f"your file (default ./{DEFAULT_DIR}/NAME.py)")
    ck.add_argument("--json", action="store_true", help='{"passed": bool, "checks": [{name, ok, message}]}')
    ht = sp.add_parser("hint", help="the next hint (each call shows one more)")
    ht.add_argument("name")
    ht.add_argument("--all", action="store_true", help="every hint at once")
    sp.add_parser("progress", help="which exercises pass")
    # The actions whose arguments and work live beside their code in qkv/learn/ (each module keeps
    # its top level light: torch and the models are imported when the action runs).
    for name, (module, help_, add, _) in MODULE_ACTIONS.items():
        getattr(importlib.import_module(module), add)(sp.add_parser(name, help=help_, description=help_))
    p.set_defaults(func=cmd_learn, action=None)


# action -> (module, help, its add-arguments function, its main function)
MODULE_ACTIONS: dict[str, tuple[str, str, str, str]] = {
    "run": ("qkv.learn.runner", "put your function inside a real qkv model (GPT on Shakespeare, SmolLM2, "
            "the dates RNN) and compare it with qkv's own", "add_arguments", "main"),
    "quiz": ("qkv.learn.quiz", "predict, then reveal: questions computed from a model, answered with "
             "the lens", "add_arguments", "main"),
    "notebook": ("qkv.learn.notebook", "write one lecture's exercises as a Jupyter notebook with check "
                 "cells", "add_arguments", "main"),
    "export": ("qkv.learn.course", "for a course: a student bundle (stubs, notebooks, public checks) and "
               "a separate grader", "add_export_arguments", "export_main"),
    "grade": ("qkv.learn.course", "grade a folder of submissions into CSV and JSON (one row per student, "
              "one column per exercise)", "add_grade_arguments", "grade_main"),
}


def cmd_learn(args: argparse.Namespace) -> int:
    action = args.action or "list"
    actions = {"list": _list, "start": _start, "check": _check, "hint": _hint, "progress": _progress}
    if action in MODULE_ACTIONS:
        module, _, _, main = MODULE_ACTIONS[action]
        return getattr(importlib.import_module(module), main)(args)
    return actions[action](args)


def _status(name: str) -> str:
    from qkv.learn import progress

    done = progress.load().get(name)
    if done is None:
        return "started" if (Path(DEFAULT_DIR) / f"{name}.py").is_file() else "not started"
    return done.state() if done.passed or done.status else f"failing ({done.ok}/{done.total} checks)"


def _list(args: argparse.Namespace) -> int:
    from qkv.learn import EXERCISES

    rows = [{"name": e.name, "section": e.section, "difficulty": e.difficulty, "status": _status(e.name),
             "see": e.see} for e in EXERCISES.values()]
    if getattr(args, "json", False):
        print(json.dumps(rows, ensure_ascii=False, indent=1))
        return 0
    from qkv.explain.lectures import LECTURES

    print("qkv learn: write each function yourself; `qkv learn start NAME`, then `qkv learn check NAME`.")
    for lec in LECTURES:
        for section in lec.sections:
            here = [r for r in rows if r["section"] == section.title]
            if here:
                print(f"\n{lec.name.split(':')[0]} · {section.title}")
            for r in here:
                print(f"  {r['name']:28s} {'*' * r['difficulty']:3s} {r['status']}")
    return 0


def _start(args: argparse.Namespace) -> int:
    from qkv.learn import get

    e = get(args.name)
    folder = Path(args.dir)
    target = folder / f"{e.name}.py"
    if target.exists():
        print(f"{target} exists; it is yours: edit it, then `qkv learn check {e.name}"
              f"{'' if args.dir == DEFAULT_DIR else ' ' + str(target)}`")
        return 0
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--dir {folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    from qkv.fileio import atomic_write

    atomic_write(target, lambda tmp: tmp.write_text(e.stub_file(), encoding="utf-8"))
    print(f"wrote {target}: fill in {e.name}, then `qkv learn check {e.name}"
          f"{'' if args.dir == DEFAULT_DIR else ' ' + str(target)}` (see it in qkv: `{e.see}`)")
    return 0


def _check(args: argparse.Namespace) -> int:
    from qkv.learn import get, progress
    from qkv.learn.judge import run_checks

    e = get(args.name)
    path = Path(args.file) if args.file else Path(DEFAULT_DIR) / f"{e.name}.py"
    report = run_checks(e.name, path)
    progress.record(report, path)
    if args.json:
        print(json.dumps(report.as_dict(), ensure_ascii=False))
    else:
        print(report.text())
        if not report.passed:
            print(f"(stuck? `qkv learn hint {e.name}`)", file=sys.stderr)
    return 0 if report.passed else 1


def _hint(args: argparse.Namespace) -> int:
    from qkv.learn import get
    from qkv.paths import cache_root

    e = get(args.name)
    seen_file = None if cache_root() is None else cache_root() / "learn" / "hints.json"  # type: ignore[operator]
    seen: dict[str, int] = {}
    if seen_file is not None:
        try:
            seen = json.loads(seen_file.read_text())
        except (OSError, ValueError):
            seen = {}
    n = len(e.hints) if args.all else min(seen.get(e.name, 0) + 1, len(e.hints))
    for i, h in enumerate(e.hints[:n], 1):
        print(f"hint {i}/{len(e.hints)}: {h}")
    if n < len(e.hints):
        print(f"(`qkv learn hint {e.name}` again for the next one)")
    if seen_file is not None:
        seen[e.name] = n
        from qkv.fileio import atomic_write

        try:
            atomic_write(seen_file, lambda tmp: tmp.write_text(json.dumps(seen)))
        except OSError:
            pass
    return 0


def _progress(args: argparse.Namespace) -> int:
    from qkv.learn import EXERCISES, progress

    done = progress.load()
    passed = [n for n in EXERCISES if done.get(n) is not None and done[n].passed]
    print(f"{len(passed)} of {len(EXERCISES)} exercises pass")
    quiz = progress.quiz_summary()
    if quiz:
        print(f"quiz: {quiz}")
    for n in EXERCISES:
        a = done.get(n)
        state = "not checked yet" if a is None else a.state()
        print(f"  {n:30s} {state}{'' if a is None else f'  ({a.when})'}")
    return 0
