"""--dtype auto / --compile auto: the probe picks what a (fake) clock says is faster, caches
it, leaves the run untouched, and an explicit choice always wins; a measurement taken while
other programs took the CPU (a fake watch, and once real CPU hogs) is neither trusted nor cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from helpers import forbid_probe

from qkv.models.gpt import GPT, GPTConfig
from qkv.training import probe
from qkv.training import trainer as trainer_mod
from qkv.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
RealWatch = probe.Watch  # the ``machine`` fixture replaces probe.Watch


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))


class FakeWatch:
    """probe.Watch's stand-in: every measurement saw this process get ``share`` of the CPU it
    wanted (over a second of it)."""

    share = 1.0

    def stop(self) -> probe.Sharing:
        return probe.Sharing(type(self).share, 1.0, 0.5, 2, torch.get_num_threads())


@pytest.fixture(autouse=True)
def machine(request, monkeypatch) -> type[FakeWatch] | None:
    """A quiet machine, whatever this one is doing (set ``machine.share`` to make it busy);
    a test that starts real CPU hogs (the ``hogs`` fixture) watches the real one instead."""
    if "hogs" in request.fixturenames:
        return None
    watch = type("Watch", (FakeWatch,), {"share": 1.0})
    monkeypatch.setattr(probe, "Watch", watch)
    return watch


class RandomBatches:
    def get_batch(self, split, batch_size, generator):
        x = torch.randint(0, 20, (batch_size, 8), generator=generator)
        return x, torch.roll(x, -1, dims=1)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, max_seq_len=8, dim=16, n_layers=1, n_heads=2))


def cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(tmp_path), batch_size=4, max_iters=4, eval_interval=2, eval_iters=1,
                device="cpu", optimizer="adamw")
    return TrainConfig(**{**base, **kw})


class FakeClock:
    """A timer that advances by the cost of the option the step just ran."""

    def __init__(self, cost: dict[str, float]) -> None:
        self.now, self.cost, self.calls = 0.0, cost, {k: 0 for k in cost}

    def step(self, option: str) -> None:
        self.now += self.cost[option]
        self.calls[option] += 1

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("fp32_s", "bf16_s", "pick"), [(0.010, 0.007, "bf16"), (0.007, 0.010, "fp32"),
                                                        (0.0100, 0.0099, "fp32")])  # a tie: fp32
def test_time_options_and_choice_follow_the_clock(fp32_s: float, bf16_s: float, pick: str) -> None:
    clock = FakeClock({"fp32": fp32_s, "bf16": bf16_s})
    ms = probe.time_options(clock.step, ("fp32", "bf16"), rounds=3, steps=2, timer=clock)
    assert ms == pytest.approx({"fp32": fp32_s * 1000, "bf16": bf16_s * 1000})
    assert clock.calls == {"fp32": 7, "bf16": 7}  # one warm-up + 3 rounds of 2 each
    dtype, reason = probe.choose_dtype(ms)
    assert dtype == pick and reason.endswith(f"-> {pick}")
    assert f"({fp32_s / bf16_s:.2f}x)" in reason


def force_probe(monkeypatch, ms: dict[str, float], native: bool = True) -> list[int]:
    """Make the trainer believe the CPU has bf16 instructions and that the probe measured ``ms``."""
    calls: list[int] = []
    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: native)

    def fake(step, options, rounds=3, steps=2, timer=None):
        calls.append(1)
        for o in options:
            step(o)  # the real step runs once each way: it must not touch the run
        return {o: ms[o] for o in options}

    monkeypatch.setattr(probe, "time_options", fake)
    return calls


@pytest.mark.parametrize(("ms", "want"), [({"fp32": 10.0, "bf16": 6.0}, torch.bfloat16),
                                          ({"fp32": 6.0, "bf16": 10.0}, torch.float32)])
def test_auto_dtype_takes_the_faster_and_caches_it(tmp_path, monkeypatch, ms, want) -> None:
    calls = force_probe(monkeypatch, ms)
    t = Trainer(gpt(), cfg(tmp_path, compile=False), RandomBatches(), tmp_path)
    assert t.dtype == want and len(calls) == 1 and not t.speed.cached
    assert "bf16 autocast" in t.speed.reason
    entry = next(iter(json.loads(probe.cache_path().read_text()).values()))
    assert entry["dtype"] == {torch.bfloat16: "bf16", torch.float32: "fp32"}[want]
    # The same shape again: answered from the cache, nothing measured.
    t2 = Trainer(gpt(), cfg(tmp_path, compile=False), RandomBatches(), tmp_path)
    assert t2.dtype == want and len(calls) == 1 and t2.speed.cached and "(cached)" in t2.speed.reason
    # Another shape (batch size) is measured afresh.
    Trainer(gpt(), cfg(tmp_path, compile=False, batch_size=5), RandomBatches(), tmp_path)
    assert len(calls) == 2


@pytest.mark.parametrize("asked", ["fp32", "bf16"])
def test_an_explicit_dtype_always_wins(tmp_path, monkeypatch, asked: str) -> None:
    calls = force_probe(monkeypatch, {"fp32": 10.0, "bf16": 1.0} if asked == "fp32" else
                        {"fp32": 1.0, "bf16": 10.0})
    Trainer(gpt(), cfg(tmp_path, compile=False), RandomBatches(), tmp_path)  # caches the other one
    t = Trainer(gpt(), cfg(tmp_path, compile=False, dtype=asked), RandomBatches(), tmp_path)
    assert t.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[asked]
    assert len(calls) == 1  # the explicit run measured nothing


def test_probe_leaves_model_optimizer_and_rng_untouched(tmp_path, monkeypatch) -> None:
    force_probe(monkeypatch, {"fp32": 10.0, "bf16": 6.0})
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    t = Trainer(model, cfg(tmp_path, compile=False), RandomBatches(), tmp_path)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(not opt.state for opt in t.optimizers)  # no optimiser step was taken on the run


def test_no_bf16_instructions_means_fp32_without_probing(tmp_path, monkeypatch) -> None:
    calls = force_probe(monkeypatch, {"fp32": 10.0, "bf16": 1.0}, native=False)
    t = Trainer(gpt(), cfg(tmp_path, compile=False), RandomBatches(), tmp_path)
    assert t.dtype == torch.float32 and not calls
    assert "no bf16 instructions" in t.speed.reason


def test_bf16_asked_on_an_emulating_cpu_warns_with_the_measured_cost(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(gpt(), cfg(tmp_path, compile=False, dtype="bf16"), RandomBatches(), tmp_path)
    assert t.dtype == torch.bfloat16  # asked for: given, with the warning
    text = " ".join(str(w.message) for w in caught)
    assert "without bf16 instructions" in text and "as long as fp32" in text


def test_compile_auto_is_on_only_when_the_run_can_repay_it() -> None:
    # 50 ms steps, 10% saved: 1,000 steps save 5 s (< 40 s compile); 10,000 save 50 s.
    assert probe.compile_worth_trying(50.0, 1000, None)[0] is False
    worth, why = probe.compile_worth_trying(50.0, 10_000, None)
    assert worth and "save ~50 s" in why and "typical 40 s" in why
    # A measured compile time and saving on this machine replace the assumptions.
    assert probe.compile_worth_trying(50.0, 10_000, {"compile_s": 80.0, "compile_saving": 0.1})[0] is False
    assert probe.compile_worth_trying(50.0, 1000, {"compile_s": 2.0, "compile_saving": 0.05})[0] is True


def test_compile_auto_in_the_trainer_uses_the_measured_step(tmp_path, monkeypatch) -> None:
    force_probe(monkeypatch, {"fp32": 10.0, "bf16": 20.0})
    t = Trainer(gpt(), cfg(tmp_path), RandomBatches(), tmp_path)  # 4 steps of 10 ms: never pays
    assert t.speed.compile is False and not t.compiled and "compile off" in t.speed.reason


def test_a_damaged_cache_is_measured_again(tmp_path, monkeypatch) -> None:
    calls = force_probe(monkeypatch, {"fp32": 10.0, "bf16": 6.0})
    probe.cache_path().parent.mkdir(parents=True, exist_ok=True)
    probe.cache_path().write_text("{not json")
    t = Trainer(gpt(), cfg(tmp_path, compile=False), RandomBatches(), tmp_path)
    assert t.dtype == torch.bfloat16 and len(calls) == 1
    assert json.loads(probe.cache_path().read_text())  # rewritten whole


def test_muon_orthogonalises_in_fp32_where_bf16_is_emulated(tmp_path, monkeypatch) -> None:
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda native=native: native)
        t = Trainer(gpt(), cfg(tmp_path, optimizer="auto", dtype="fp32", compile=False),
                    RandomBatches(), tmp_path)
        assert t.optimizer_kind == "muon" and t.optimizers[0].ns_dtype == want


# --------------------------------------------------------------------------- what the run records


def put_cache(model, c: TrainConfig, data, entry: dict, optimizer: str = "adamw") -> str:
    """Write ``entry`` under the key the trainer computes for this model, config and data."""
    from qkv.training import speed

    key = speed.cache_key(model, c, speed.probe_batch(data, c)[0], optimizer)
    probe.write_cache(key, entry)
    return key


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_record_is_what_the_trainer_uses(tmp_path, monkeypatch, dtype: str) -> None:
    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: True)
    forbid_probe(monkeypatch)
    c = cfg(tmp_path, max_iters=40)
    put_cache(gpt(), c, RandomBatches(), {"dtype": dtype, "dtype_reason": f"forced -> {dtype}",
                                          "ms": {dtype: 7.5}, "compile_s": 1e6})
    t = Trainer(gpt(), c, RandomBatches(), tmp_path)
    rec = t.chosen()
    assert t.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert (rec.dtype, rec.compile, rec.step_ms, rec.optimizer) == (dtype, False, 7.5, "adamw")
    assert rec.compile == t.compiled and rec.muon_ns_dtype is None and rec.device == "cpu"
    assert rec.dtype_why == f"forced -> {dtype} (cached)"
    assert "1000000 s of compiling measured here" in rec.compile_why
    assert rec.cpu["native_bf16"] is True and rec.cpu["threads"] == torch.get_num_threads()
    assert rec.cpu["torch"] == torch.__version__


def test_a_recorded_choice_is_used_without_probing_unless_asked_again(tmp_path, monkeypatch) -> None:
    from qkv.training.speed import Chosen

    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: True)
    forbid_probe(monkeypatch)
    rec = Chosen(dtype="bf16", dtype_why="measured then", compile=False, compile_why="off then",
                 step_ms=3.0, optimizer="adamw", muon_ns_dtype=None, device="cpu")
    t = Trainer(gpt(), cfg(tmp_path), RandomBatches(), tmp_path, recorded=rec)
    assert t.dtype == torch.bfloat16 and not t.compiled and t.speed.recorded
    assert t.chosen().dtype_why == "measured then"
    assert t.speed.reason == "as this run recorded in its config.json (measured then; off then)"
    t = Trainer(gpt(), cfg(tmp_path, dtype="fp32"), RandomBatches(), tmp_path, recorded=rec)
    assert t.dtype == torch.float32 and t.chosen().dtype_why == "fp32 as asked"


# --------------------------------------------------------------------------- the compile meter


def meter(**kw):
    from qkv.training.speed import CompileMeter

    return CompileMeter(**{"eager_s": 1.0, "max_iters": 1000, "saving_prior": 0.1, **kw})


def test_one_cold_compile_is_never_undone() -> None:
    m = meter(max_iters=100)  # 100 steps can save ~10 s; the cold compile cost 40 s
    assert m.observe(0, 41.0, compiled=3, shapes=[(8, 16)]) is None  # paid: stopping saves nothing
    assert all(m.observe(s, 0.8, compiled=0, shapes=[(8, 16)]) is None for s in range(1, 50))
    assert m.skip(50, [(8, 16)]) is None  # the shape it compiled for: nothing more to pay
    assert m.measured_saving() == pytest.approx(0.2) and m.spent_s == pytest.approx(40.0)
    assert m.cache_entry() == ({"compile_s": 40.0, "compile_saving": 0.2}, "kept for the next run's choice")


def test_a_new_shape_is_run_eagerly_once_a_compile_costs_more_than_is_left_to_save() -> None:
    m = meter()  # 1,000 steps of 1 s, 10% saved: ~100 s to win
    assert m.skip(0, [(8, 16)]) is None  # the first compile was the auto decision's to make
    m.observe(0, 41.0, compiled=1, shapes=[(8, 16)])
    assert m.skip(1, [(8, 17)]) is None  # another 40 s compile < 99.9 s still to win
    m.observe(1, 41.0, compiled=1, shapes=[(8, 17)])
    assert m.skip(500, [(8, 18)]) is None  # 40 s < the ~50 s still to win
    assert m.skip(700, [(8, 17)]) is None  # a shape compiled for already
    why = m.skip(700, [(8, 18)])  # 40 s > the ~30 s left
    assert why == ("a new input shape would compile again (~40 s each here), more than the ~30 s "
                   "compiling can still save")


def test_a_recompile_stops_compiling_once_it_costs_more_than_it_can_still_save() -> None:
    m = meter()  # 1,000 steps of 1 s, 10% saved: ~100 s to win
    assert m.observe(0, 41.0, compiled=1) is None
    assert m.observe(1, 0.9, compiled=0) is None
    assert m.observe(2, 41.0, compiled=1) is None  # 80 s paid < 99.7 s still to win
    assert m.observe(3, 41.0, compiled=1) == "more than the ~100 s compiling can still save"  # 120 s paid
    assert m.compile_steps == 3 and m.spent_s == pytest.approx(120.0)
    assert m.cache_entry()[0] == {"compile_s": 120.0}  # one fast step: the saving is not measured


def test_compiled_steps_no_faster_than_eager_stop_compiling() -> None:
    m = meter()
    m.observe(0, 5.0, compiled=1)
    assert [m.observe(s, 1.05, compiled=0) for s in range(1, 6)] == \
        [None] * 4 + ["compiled steps are no faster than eager here"]
    assert m.measured_saving() == pytest.approx(-0.05)


class FakeCompiled(torch.nn.Module):
    """torch.compile's stand-in: a call 'compiles' (one frame, 50 s on the fake clock) when
    ``compiles(call, shape)`` says so, else takes 5 ms. It runs the model itself, so the
    numbers are eager's."""

    def __init__(self, model: torch.nn.Module, clock: FakeClock, frames: list[int], compiles) -> None:
        super().__init__()
        self.model, self.clock, self.frames, self.compiles = model, clock, frames, compiles
        self.shapes: list[tuple] = []

    def forward(self, x, y):
        again = self.compiles(len(self.shapes), tuple(x.shape), self.shapes)
        self.clock.now += 50.0 if again else 0.005
        self.frames[0] += again
        self.shapes.append(tuple(x.shape))
        return self.model(x, y)


class VariableBatches:
    """Batches trimmed to a random length 4-8, as seq2seq's are to their longest row."""

    def get_batch(self, split, batch_size, generator):
        n = int(torch.randint(4, 9, (1,), generator=generator))
        x = torch.randint(0, 20, (batch_size, n), generator=generator)
        return x, torch.roll(x, -1, dims=1)


def new_shape(call: int, shape: tuple, seen: list) -> bool:
    return shape not in seen  # a graph specialised to each shape (the RNN's unrolled decoder)


def every_tenth(call: int, shape: tuple, seen: list) -> bool:
    return call % 10 == 0  # recompiles the shapes do not foretell (guards on something else)


@pytest.mark.parametrize(("compiles", "batches"), [(new_shape, VariableBatches),
                                                   (every_tenth, RandomBatches)])
def test_compiling_that_costs_more_than_it_saves_falls_back_to_eager(tmp_path, monkeypatch, compiles,
                                                                      batches) -> None:
    from qkv.training import speed

    clock, frames, made = FakeClock({}), [0], []

    def fake_compile(model, **kw):
        made.append(FakeCompiled(model, clock, frames, compiles))
        return made[-1]

    monkeypatch.setattr(speed, "clock", clock)
    monkeypatch.setattr(speed, "compile_count", lambda: frames[0])
    monkeypatch.setattr(torch, "compile", fake_compile)
    forbid_probe(monkeypatch)
    c = cfg(tmp_path / "run", dtype="fp32", max_iters=40, eval_interval=20)
    key = put_cache(gpt(), c, batches(), {"ms": {"fp32": 10.0}, "compile_s": 0.01,
                                          "compile_saving": 0.5})
    recorded = []
    t = Trainer(gpt(), c, batches(), tmp_path / "run", on_choice=recorded.append)
    assert t.compiled and t.meter is not None  # 40 steps x 5 ms saved > the 0.01 s on file
    t.fit()
    # Where it stops: before the first step with a shape not compiled yet (50 s > the <0.2 s
    # left to save), or after the second recompile no shape foretold (step 11).
    gen = torch.Generator().manual_seed(c.seed)
    shapes = [tuple(batches().get_batch("train", 4, gen)[0].shape) for _ in range(40)]
    first_new = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
    stop, paid = (first_new, 50.0) if compiles is new_shape else (11, 100.0)
    assert stop is not None
    assert len(made[0].shapes) == stop  # not one compiled step after it
    assert not t.compiled and t.step == 40 and t.compile_stopped_at == stop
    rec = recorded[-1]
    assert (rec.compile, rec.compile_stopped_at) == (False, stop)
    assert rec.compile_why.startswith(f"compile stopped after step {stop}: compiling cost ~{paid:.0f} s")
    entry = json.loads(probe.cache_path().read_text())[key]
    assert entry["compile_s"] == pytest.approx(paid, abs=0.1)  # each compile: 50 s - the 10 ms eager step
    # Training went on exactly: the same weights as a run that never compiled.
    eager = Trainer(gpt(), cfg(tmp_path / "eager", dtype="fp32", compile=False, max_iters=40,
                               eval_interval=20), batches(), tmp_path / "eager")
    eager.fit()
    for (k, a), b in zip(t.model.state_dict().items(), eager.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    # The next run of this shape reads what this one paid and does not compile.
    again = Trainer(gpt(), c, batches(), tmp_path / "again")
    assert not again.compiled and f"{paid:.0f} s of compiling measured here" in again.speed.compile_why


def test_a_compile_that_fails_is_recorded_as_eager(tmp_path, monkeypatch) -> None:
    class Broken(torch.nn.Module):
        def forward(self, x, y):
            raise RuntimeError("torch.compile backend failed: no C compiler")

    monkeypatch.setattr(torch, "compile", lambda m, **kw: Broken())
    recorded = []
    t = Trainer(gpt(), cfg(tmp_path, dtype="fp32", compile=True), RandomBatches(), tmp_path,
                on_choice=recorded.append)
    assert t.compiled and t.chosen().compile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit()
    assert t.step == 4 and not t.compiled
    assert recorded[-1].compile is False
    assert recorded[-1].compile_why == "compile failed here (RuntimeError) -> eager"


def test_a_recorded_bf16_on_a_cpu_that_emulates_it_warns(tmp_path, monkeypatch) -> None:
    from qkv.training.speed import Chosen

    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: False)
    rec = Chosen(dtype="bf16", dtype_why="measured elsewhere", compile=False, compile_why="",
                 step_ms=None, optimizer="adamw", muon_ns_dtype=None, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(gpt(), cfg(tmp_path), RandomBatches(), tmp_path, recorded=rec)
    assert t.dtype == torch.bfloat16  # the record is kept, with the cost said
    text = " ".join(str(w.message) for w in caught)
    assert "as this run recorded; --dtype fp32 changes it" in text and "as long as fp32" in text


# --------------------------------------------------------------------------- a busy machine


def test_the_watch_sums_what_every_thread_ran_and_waited(monkeypatch) -> None:
    ms = 1_000_000
    readings = iter([{1: (100 * ms, 0), 2: (50 * ms, 10 * ms)},  # thread 2 ends, thread 3 starts
                     {1: (400 * ms, 300 * ms), 3: (100 * ms, 100 * ms)}])
    monkeypatch.setattr(probe, "thread_times", lambda: next(readings))
    monkeypatch.setattr(probe, "load_average", lambda: 4.9)
    s = RealWatch().stop()
    assert (s.share, s.wanted_s, s.load) == (pytest.approx(0.5), pytest.approx(0.8), 4.9)
    assert s.busy and s.threads == torch.get_num_threads()
    assert s.note() == (f"the machine was busy while measuring (this process got 50% of the CPU its "
                        f"{s.threads} thread{'s' * (s.threads != 1)} wanted; load 4.9 on {s.cores} cores): "
                        "not cached, measured again next run")


@pytest.mark.parametrize(("sharing", "busy"), [
    (probe.Sharing(0.95, 1.0, 0.2, 2, 2), False),   # a quiet machine: 0.97-1.00 measured
    (probe.Sharing(0.60, 1.0, 0.2, 2, 2), True),    # beside CPU hogs: 0.25-0.63 measured
    (probe.Sharing(0.30, 0.01, 0.2, 2, 2), False),  # 10 ms wanted: too short to judge
    (probe.Sharing(None, None, 4.5, 2, 2), True),   # no schedstat: others' load fills both cores
    (probe.Sharing(None, None, 3.5, 2, 2), False),  # ... or may be this process's own 2 threads
    (probe.Sharing(None, None, None, 2, 2), False),  # nothing known: trusted, as before
])
def test_what_counts_as_busy(sharing: probe.Sharing, busy: bool) -> None:
    assert sharing.busy is busy


def test_the_watch_reads_this_process_threads() -> None:
    times = probe.thread_times()
    if times is None:
        pytest.skip("this kernel keeps no per-thread schedstat")
    assert times[threading.get_native_id()][0] > 0  # this thread has run


def test_a_busy_measurement_is_not_trusted_nor_cached(tmp_path, monkeypatch, machine) -> None:
    calls = force_probe(monkeypatch, {"fp32": 10.0, "bf16": 6.0})  # bf16 measured 1.67x faster
    machine.share = 0.35
    notes: list[str] = []
    t = Trainer(gpt(), cfg(tmp_path, max_iters=2, eval_interval=2), RandomBatches(), tmp_path,
                on_log=lambda rec: notes.append(rec.get("note", "")))
    assert t.dtype == torch.float32 and not t.compiled and len(calls) == 1
    assert t.speed.dtype_why == "bf16 autocast 6.0 ms/step vs fp32 10.0 (1.67x) on a busy machine -> fp32"
    assert t.speed.compile_why == "compile off: the step was timed on a busy machine"
    assert probe.cache_path() is not None and not probe.cache_path().exists()
    rec = t.chosen()
    assert (rec.busy, rec.cpu_share, rec.step_ms) == (True, 0.35, 10.0)
    t.fit()
    busy = [n for n in notes if "busy while measuring" in n]
    assert busy == ["speed: the machine was busy while measuring (this process got 35% of the CPU its 1 "
                    "thread wanted; load 0.5 on 2 cores): not cached, measured again next run"]
    # The next run, on a quiet machine, measures again, trusts it and caches it.
    machine.share = 1.0
    t2 = Trainer(gpt(), cfg(tmp_path, compile=False), RandomBatches(), tmp_path)
    assert t2.dtype == torch.bfloat16 and len(calls) == 2 and not t2.speed.busy
    assert (t2.chosen().busy, t2.chosen().cpu_share) == (False, 1.0)
    assert next(iter(json.loads(probe.cache_path().read_text()).values()))["dtype"] == "bf16"


def test_a_busy_record_is_kept_on_resume_and_checked(tmp_path, monkeypatch) -> None:
    from qkv.training.speed import Chosen

    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: True)
    forbid_probe(monkeypatch)
    rec = Chosen(dtype="fp32", dtype_why="busy then", compile=False, compile_why="off then", step_ms=3.0,
                 optimizer="adamw", muon_ns_dtype=None, device="cpu", cpu_share=0.4, busy=True)
    t = Trainer(gpt(), cfg(tmp_path), RandomBatches(), tmp_path, recorded=rec)
    assert (t.chosen().busy, t.chosen().cpu_share) == (True, 0.4)
    saved = {"chosen": {**{k: getattr(rec, k) for k in rec.__dataclass_fields__}}}
    assert Chosen.read(saved) == rec
    with pytest.raises(ValueError, match=r"chosen\.busy is 'yes'"):
        Chosen.read({"chosen": {**saved["chosen"], "busy": "yes"}})
    old = {k: v for k, v in saved["chosen"].items() if k not in ("busy", "cpu_share")}
    assert Chosen.read({"chosen": old}).busy is False  # a record from before issue 39


def test_compile_time_measured_on_a_busy_machine_is_not_kept(tmp_path, monkeypatch, machine) -> None:
    from qkv.training import speed

    clock, frames, made = FakeClock({}), [0], []

    def fake_compile(model, **kw):
        made.append(FakeCompiled(model, clock, frames, new_shape))
        return made[-1]

    monkeypatch.setattr(speed, "clock", clock)
    monkeypatch.setattr(speed, "compile_count", lambda: frames[0])
    monkeypatch.setattr(torch, "compile", fake_compile)
    forbid_probe(monkeypatch)
    c = cfg(tmp_path, dtype="fp32", max_iters=10, eval_interval=10)
    on_file = {"ms": {"fp32": 10.0}, "compile_s": 0.01, "compile_saving": 0.5}
    key = put_cache(gpt(), c, RandomBatches(), on_file)
    notes: list[str] = []
    t = Trainer(gpt(), c, RandomBatches(), tmp_path, on_log=lambda rec: notes.append(rec.get("note", "")))
    assert t.compiled and t.meter is not None
    machine.share = 0.3  # other programs start while it trains
    t.fit()
    assert t.meter.compile_steps == 1 and t.meter.spent_s == pytest.approx(50.0, abs=0.1)
    assert json.loads(probe.cache_path().read_text())[key] == on_file  # not the busy 50 s
    assert [n for n in notes if n.startswith("compile:")] == [
        f"compile: {t.meter.summary()} (not kept: the machine was busy (this process got 30% of the CPU "
        "its 1 thread wanted; load 0.5 on 2 cores))"]


class Tokens:
    """Batches of a GPT big enough that the probe wants ~0.5 s of CPU."""

    def get_batch(self, split, batch_size, generator):
        x = torch.randint(0, 64, (batch_size, 32), generator=generator)
        return x, torch.roll(x, -1, dims=1)


@pytest.fixture
def hogs():
    """Two processes that spin on the core this thread is pinned to (its affinity restored after):
    one core, shared three ways, whatever the machine's size."""
    if probe.thread_times() is None or not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs Linux's per-thread schedstat and CPU affinity")
    before = os.sched_getaffinity(0)
    core = {min(before)}
    spin = "import sys\nprint('spinning', flush=True)\nwhile True: pass"
    procs: list[subprocess.Popen] = []
    try:
        os.sched_setaffinity(0, core)  # this thread only (Linux): the one torch computes on
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True))
            os.sched_setaffinity(procs[-1].pid, core)
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "spinning\n"
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        os.sched_setaffinity(0, before)


def test_a_probe_beside_cpu_hogs_is_not_cached(tmp_path, monkeypatch, hogs) -> None:
    monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda: True)  # measure both ways
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=32, dim=64, n_layers=2, n_heads=4))
    t = Trainer(model, cfg(tmp_path, batch_size=8), Tokens(), tmp_path)
    assert all(p.poll() is None for p in hogs)  # still spinning: the probe shared its core
    assert t.speed.busy.startswith("the machine was busy while measuring (this process got ")
    assert t.speed.cpu_share is not None and t.speed.cpu_share < probe.MIN_CPU_SHARE
    assert t.dtype == torch.float32 and not t.compiled and t.chosen().busy
    assert not probe.cache_path().exists()
