"""qkv.serve.registry: ``max_loaded`` is a bound on the models in memory (being loaded, loaded,
or replaced but still in use), enforced before a load starts; checked with a slow fake loader
whose models count themselves alive until they are garbage, and many threads at once."""

from __future__ import annotations

import os
import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import qkv.serve.registry as registry_module
from qkv.serve.loop import BusyError
from qkv.serve.registry import Registry


class FakeLoader:
    """Stands for open_model: slow, and counting the models alive (from the start of their
    load until the last reference is gone) and the most ever alive at once."""

    def __init__(self, seconds: float = 0.01, broken: tuple[str, ...] = ()) -> None:
        self.seconds, self.broken = seconds, broken
        self.lock = threading.Lock()
        self.alive = self.peak = self.loads = 0

    def _gone(self) -> None:
        with self.lock:
            self.alive -= 1

    def __call__(self, ref, **kwargs):
        target, display_name = ref.path, ref.name
        with self.lock:
            self.alive += 1
            self.loads += 1
            self.peak = max(self.peak, self.alive)
        time.sleep(self.seconds)
        if display_name in self.broken:
            self._gone()
            from qkv.training.checkpoint import CheckpointError

            raise CheckpointError(f"{target}/model.safetensors is damaged")
        model = type("FakeSource", (), {})()
        model.name = display_name
        weakref.finalize(model, self._gone)
        return model


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """Eight gpt runs (a config.json that names the family, and a weights file for the version)."""
    root = tmp_path / "runs"
    for i in range(8):
        (root / f"r{i}").mkdir(parents=True)
        (root / f"r{i}" / "config.json").write_text('{"family": "gpt"}')
        (root / f"r{i}" / "model.safetensors").write_bytes(b"")
    return root


@pytest.fixture
def loader(monkeypatch) -> FakeLoader:
    fake = FakeLoader()
    monkeypatch.setattr(registry_module, "open_model", fake)
    return fake


def test_many_distinct_runs_at_once_never_exceed_max_loaded(runs, loader) -> None:
    reg = Registry(runs, max_loaded=2, max_wait_s=30)
    order = [f"runs/r{i % 8}" for i in range(96)]
    random.Random(0).shuffle(order)

    def ask(model_id: str) -> str:
        with reg.use(model_id) as src:
            assert reg.in_memory() <= 2
            time.sleep(0.002)  # a request's work, with the model held
            return src.name

    with ThreadPoolExecutor(max_workers=16) as pool:
        names = list(pool.map(ask, order))
    assert names == order  # each request got its own model
    assert loader.loads > 8  # models were dropped and loaded again: the bound was in play
    assert loader.peak <= 2, f"{loader.peak} models were in memory at once; the limit is 2"
    assert reg.in_memory() == loader.alive <= 2


def test_a_load_waits_while_every_model_is_in_use(runs, loader) -> None:
    reg = Registry(runs, max_loaded=1, max_wait_s=0.05)
    held = reg.acquire("runs/r0")
    with pytest.raises(BusyError, match=r"cannot load runs/r1 now: the 1 models in memory \(the limit\) "
                                        r"are all in use; try again in a few seconds") as e:
        reg.acquire("runs/r1")
    assert e.value.retry_after >= 1 and loader.alive == 1
    assert reg.get("runs/r0") is held.src  # the model in use is shared, not loaded again
    held.release()
    del held  # the test's own reference
    assert reg.get("runs/r1").name == "runs/r1"
    assert (reg.in_memory(), loader.alive, loader.loads) == (1, 1, 2)  # r0 went before r1 loaded


def test_least_recently_used_goes_first(runs, loader) -> None:
    reg = Registry(runs, max_loaded=2)
    a = reg.get("runs/r0")
    reg.get("runs/r1")
    assert reg.get("runs/r0") is a  # r0 used last: r1 is the least recently used
    reg.get("runs/r2")
    assert reg.peek("runs/r0") is a and reg.peek("runs/r1") is None
    assert loader.peak == 2


def test_a_run_replaced_on_disk_while_in_use_still_counts(runs, loader) -> None:
    reg = Registry(runs, max_loaded=2, max_wait_s=0.05)
    old = reg.acquire("runs/r0")
    weights = runs / "r0" / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # retrained
    new = reg.acquire("runs/r0")
    assert new.src is not old.src and reg.in_memory() == 2  # the old one is still in use
    with pytest.raises(BusyError):  # so there is no room for a third
        reg.acquire("runs/r1")
    old.release()
    assert reg.in_memory() == 1 and loader.alive == 2  # the test still holds `old`
    del old
    assert loader.alive == 1
    new.release()
    assert reg.get("runs/r1").name == "runs/r1" and loader.peak == 2


def test_a_failed_load_leaves_nothing_behind(runs, monkeypatch) -> None:
    from qkv.training.checkpoint import CheckpointError

    fake = FakeLoader(broken=("runs/r3",))
    monkeypatch.setattr(registry_module, "open_model", fake)
    reg = Registry(runs, max_loaded=1)
    for _ in range(2):
        with pytest.raises(CheckpointError):
            reg.get("runs/r3")
    assert reg.in_memory() == 0 and fake.loads == 2
    assert reg.get("runs/r4").name == "runs/r4"


def test_one_load_per_model_however_many_ask(runs, loader) -> None:
    loader.seconds = 0.05
    reg = Registry(runs, max_loaded=2)
    with ThreadPoolExecutor(max_workers=12) as pool:
        srcs = list(pool.map(lambda _: reg.get("runs/r5"), range(12)))
    assert loader.loads == 1 and all(s is srcs[0] for s in srcs)
