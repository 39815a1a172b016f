"""A run records what the machine chose (config.json's ``chosen``): the dtype and compile setting
the probe picked, the optimiser, the preset overlay, the device and CPU; ``--resume`` trains on
with them without measuring again; a run directory written before the record still resumes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import TINY_LINES, call, forbid_probe

from qkv.families import get_family
from qkv.presets import GPT_PRESETS
from qkv.training import probe, speed
from qkv.training import run as run_mod
from qkv.training import trainer as trainer_mod

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "\n".join(TINY_LINES[:2] * 30) + "\n"


@pytest.fixture
def text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: True)  # the probe's dtype is consulted
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def trainers(monkeypatch: pytest.MonkeyPatch) -> list[trainer_mod.Trainer]:
    """Every Trainer the run lifecycle builds, to compare what it used with what was recorded."""
    made: list[trainer_mod.Trainer] = []

    class Kept(trainer_mod.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(run_mod, "Trainer", Kept)
    return made


def argv(text: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "gpt", "--preset", "tiny", "--data", str(text), "--out_dir", str(out),
            "--max_iters", "4", "--eval_interval", "2", "--eval_iters", "1", "--device", "cpu",
            "--optimizer", "adamw", "--no-progress", *extra]


def cli_cache_key(args: list[str]) -> str:
    """The probe-cache key the trainer computes for this command line."""
    from qkv.cli import build_parser
    from qkv.commands.train import configs

    f = get_family("gpt")
    model_cfg, train_cfg, data_cfg, _ = configs(f, build_parser().parse_args(args))
    prepared = f.prepare(model_cfg, data_cfg, None, lambda _t: None)
    model = f.build(prepared.model_cfg)
    return speed.cache_key(model, train_cfg, speed.probe_batch(prepared.batches, train_cfg)[0], "adamw")


def chosen(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())["chosen"]


def train(args: list[str]) -> str:
    """`qkv ARGS` in-process; its stdout."""
    rc, out, err = call(args)
    assert rc == 0, out + err
    return out


def train_quietly(args: list[str]) -> run_mod.Run:
    """What `qkv ARGS` trains (the same configs and preset record), without the evaluation,
    plots and sample that make the command slower."""
    from qkv.cli import build_parser
    from qkv.commands.train import configs

    parsed = build_parser().parse_args(args)
    f = get_family("gpt")
    model_cfg, train_cfg, data_cfg, preset = configs(f, parsed)
    return run_mod.train_run(f, model_cfg, train_cfg, data_cfg, resume=bool(parsed.resume), preset=preset,
                             evaluate=False, on_note=lambda _t: None)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_run_records_what_it_used(text, tmp_path, monkeypatch, trainers, dtype: str) -> None:
    args = argv(text, tmp_path / "run")
    probe.write_cache(cli_cache_key(args), {"dtype": dtype, "dtype_reason": f"forced -> {dtype}"})
    forbid_probe(monkeypatch)
    out = train(args)
    t, rec = trainers[0], chosen(tmp_path / "run")
    assert t.dtype == speed.DTYPES[dtype] and rec["dtype"] == dtype
    assert rec == {**dataclasses.asdict(t.chosen()), "preset": "tiny", "preset_overlay": None,
                   "preset_why": ""}
    assert (rec["compile"], rec["optimizer"], rec["device"]) == (False, "adamw", "cpu")
    assert rec["muon_ns_dtype"] is None
    assert rec["cpu"] == probe.machine(True)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert saved["dtype"] == "auto"  # what was asked stays apart from what was used
    assert f"speed: forced -> {dtype} (cached)" in out and f"using: {dtype}, compile off, adamw on cpu" in out


@pytest.fixture
def overlaid(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A tiny GPT preset with both overlays, each training its own number of steps."""
    preset = {"model": dict(max_seq_len=16, dim=16, n_layers=1, n_heads=2, bias=False),
              "train": dict(batch_size=4, max_iters=6, eval_interval=100, eval_iters=1, compile=False,
                            dtype="fp32", device="cpu"),
              "train_adamw": dict(max_iters=4), "train_fp32_ns": dict(max_iters=3)}
    monkeypatch.setitem(GPT_PRESETS, "overlaid", preset)
    return preset


@pytest.mark.parametrize(("optimizer", "native", "overlay", "steps"),
                         [("adamw", True, "train_adamw", 4), ("muon", False, "train_fp32_ns", 3),
                          ("muon", True, None, 6)])
def test_the_overlay_recorded_is_the_one_trained(text, tmp_path, monkeypatch, overlaid, optimizer: str,
                                                 native: bool, overlay: str | None, steps: int) -> None:
    import qkv.device

    if optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    monkeypatch.setattr(qkv.device, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: native)
    run = tmp_path / "run"
    args = ["train", "gpt", "--preset", "overlaid", "--data", str(text), "--out_dir", str(run),
            "--optimizer", optimizer, "--no-progress"]
    if overlay == "train_fp32_ns":  # once through the command, for its first line
        out = train(args)
        steps_trained = json.loads((run / "eval.json").read_text())["steps"]
    else:
        out, steps_trained = "", train_quietly(args).result.step
    rec = chosen(run)
    assert (rec["preset"], rec["preset_overlay"]) == ("overlaid", overlay)
    assert steps_trained == steps == json.loads((run / "config.json").read_text())["train"]["max_iters"]
    assert rec["muon_ns_dtype"] == (None if optimizer == "adamw" else "bf16" if native else "fp32")
    if overlay:
        assert ("AdamW" if optimizer == "adamw" else "fp32") in rec["preset_why"]
    if out:
        assert f"preset overlaid + {overlay} ({rec['preset_why']})," in out


def test_resume_trains_on_with_the_record_without_probing(text, tmp_path, monkeypatch, trainers) -> None:
    run = tmp_path / "run"
    args = argv(text, run)
    key = cli_cache_key(args)
    probe.write_cache(key, {"dtype": "bf16", "dtype_reason": "forced -> bf16"})
    train_quietly(args)
    probe.write_cache(key, {"dtype": "fp32", "dtype_reason": "the cache changed since"})
    forbid_probe(monkeypatch)
    out = train(["train", "gpt", "--resume", str(run), "--max_iters", "6", "--no-progress"])
    assert trainers[-1].dtype == torch.bfloat16 and trainers[-1].speed.recorded
    assert "speed: as this run recorded in its config.json (forced -> bf16 (cached)" in out
    assert "preset tiny (resumed)" in out
    assert chosen(run)["dtype"] == "bf16" and chosen(run)["preset"] == "tiny"
    # An explicit option wins, and the record follows it (the next resume keeps it).
    train_quietly(["train", "gpt", "--resume", str(run), "--max_iters", "8", "--dtype", "fp32"])
    assert trainers[-1].dtype == torch.float32
    assert (chosen(run)["dtype"], chosen(run)["dtype_why"]) == ("fp32", "fp32 as asked")
    train_quietly(["train", "gpt", "--resume", str(run), "--max_iters", "10"])
    assert trainers[-1].dtype == torch.float32
    assert json.loads((run / "config.json").read_text())["train"]["dtype"] == "auto"


def test_a_run_written_before_the_record_resumes_by_measuring(text, tmp_path, monkeypatch, trainers) -> None:
    run = tmp_path / "run"
    train_quietly(argv(text, run))
    cfg = json.loads((run / "config.json").read_text())
    del cfg["chosen"]  # config.json as runs wrote it before they recorded their choices
    (run / "config.json").write_text(json.dumps(cfg, indent=2))
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "fresh-cache"))
    measured: list[tuple[str, ...]] = []

    def fake(step, options, rounds=3, steps=2, timer=None):
        measured.append(options)
        return {"fp32": 5.0, "bf16": 10.0}

    monkeypatch.setattr(probe, "time_options", fake)
    out = train(["train", "gpt", "--resume", str(run), "--max_iters", "6", "--no-progress"])
    assert measured == [("fp32", "bf16")] and "preset (resumed)," in out
    assert trainers[-1].dtype == torch.float32 and not trainers[-1].speed.recorded
    rec = chosen(run)  # the resumed run now carries the record
    assert rec["dtype"] == "fp32"
    assert rec["dtype_why"] == "bf16 autocast 10.0 ms/step vs fp32 5.0 (0.50x) here -> fp32"
    assert rec["preset"] is None  # not known for a run from before the record
    assert json.loads((run / "eval.json").read_text())["steps"] == 6


def test_a_damaged_record_is_one_line(text, tmp_path) -> None:
    from helpers import assert_one_line_error

    run = tmp_path / "run"
    train_quietly(argv(text, run))
    cfg = json.loads((run / "config.json").read_text())
    cfg["chosen"]["dtype"] = "int3"
    (run / "config.json").write_text(json.dumps(cfg))
    rc, _, err = call(["train", "gpt", "--resume", str(run), "--max_iters", "6"])
    line = assert_one_line_error(rc, err)
    assert "config.json is damaged" in line and "chosen.dtype is 'int3'" in line
