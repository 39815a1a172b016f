"""`python _fault_driver.py KILL_JSON qkv-args...`: run `qkv.cli.main(args)` with one hook
that SIGKILLs this process at the instant KILL_JSON names (see test_faults.py); exit 3 if
that instant never came. KILL_JSON ``{}``: no hook."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from qkv import cli  # noqa: E402
from qkv.families.gpt import GPTFamily  # noqa: E402
from qkv.training import checkpoint as ckpt  # noqa: E402
from qkv.training import trainer as tr  # noqa: E402

spec = json.loads(sys.argv[1])
kind, nth = spec.get("kind"), spec.get("nth", 1)
seen = 0


def due() -> bool:
    global seen
    seen += 1
    return seen == nth


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if kind == "write":  # half of the nth write of a file of that name, then killed
    real_write = ckpt.atomic_write

    def atomic_write(path, write):
        path = Path(path)
        if path.name == spec["file"] and due():
            tmp = path.with_name(f".{path.name}.killed.tmp")  # where atomic_write would write it
            write(tmp)
            with open(tmp, "r+b") as f:
                f.truncate(os.path.getsize(tmp) // 2)
            die()
        return real_write(path, write)

    ckpt.atomic_write = atomic_write
elif kind == "rename":  # after the nth "checkpoint -> .checkpoint.old"
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        if Path(dst).name == ".checkpoint.old" and due():
            die()

    os.rename = rename
elif kind == "step":  # the nth step's update done, the step not yet counted or logged
    real_step = tr.Trainer._train_step

    def train_step(self):
        loss = real_step(self)
        if due():
            die()
        return loss

    tr.Trainer._train_step = train_step
elif kind == "append":  # half of the nth training row of metrics.jsonl
    real_append = ckpt.append_jsonl

    def append_jsonl(path, record):
        if "lr" in record and due():
            line = json.dumps(record) + "\n"
            with open(path, "a", encoding="utf-8") as f:
                f.write(line[: len(line) // 2])
            die()
        real_append(path, record)

    ckpt.append_jsonl = append_jsonl
elif kind == "evaluate":  # in the middle of the nth validation pass
    real_eval = tr.Trainer.evaluate

    def evaluate(self):
        if due():
            die()
        return real_eval(self)

    tr.Trainer.evaluate = evaluate
elif kind == "final-eval":  # scoring the finished model (eval.json not yet written)
    def final(self, model, prepared):
        die()

    GPTFamily.evaluate = final

rc = cli.main(sys.argv[2:])
sys.exit(3 if kind else rc)
