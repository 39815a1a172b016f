"""The progress display of `qkv train`: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import time


class Display:
    """Progress bar (rich) or plain lines; eval results always printed as a line."""

    def __init__(self, total: int, plain: bool, unit: str = "tok") -> None:
        self.total, self.plain, self.unit = total, plain, unit
        self.t0 = time.perf_counter()
        self.progress = None
        if not plain:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
            except ImportError:
                self.plain = True
            else:
                self.progress = Progress(
                    TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} " + unit + "/s"),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                )
                self.task = self.progress.add_task("train", total=total, completed=0,
                                                   loss="-", tok_s="-")
                self.progress.start()

    def __call__(self, rec: dict) -> None:
        if "note" in rec:
            if self.progress is not None:
                self.progress.console.print(rec["note"])
            else:
                print(rec["note"], flush=True)
            return
        if rec.get("val_loss") is not None:
            best = " (best, saved)" if rec.get("best") else ""
            line = f"step {rec['step']:>6}  val loss {rec['val_loss']:.4f}{best}"
            if self.progress is not None:
                self.progress.console.print(line)
            else:
                print(line, flush=True)
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"], loss=f"{rec['train_loss']:.4f}",
                                 tok_s=f"{rec['tokens_per_s']:,.0f}")
        elif rec["step"] % 50 == 0:
            print(f"step {rec['step']:>6}  loss {rec['train_loss']:.4f}  "
                  f"{rec['tokens_per_s']:,.0f} {self.unit}/s  lr {rec['lr']:.2e}", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
