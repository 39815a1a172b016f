"""Data-parallel training: two gloo processes on the CPU (launched by torchrun, 127.0.0.1 only)
with batch b each follow one process with batch 2b: the same losses, the same weights, and
only rank 0 writes files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import child_env, free_port, metrics
from safetensors.torch import load_file

from qkv.training.distributed import DistInfo, broadcast_flag, init_distributed, mean_across

STEPS, B = 6, 4

# One training run; writes result<rank>.json (every rank's own view) beside the run dirs.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import numpy as np
    import torch
    from safetensors.torch import save_file

    from qkv.models.gpt import GPT, GPTConfig
    from qkv.training.distributed import barrier, cleanup, init_distributed
    from qkv.data.corpora import TokenBatches
    from qkv.training.trainer import TrainConfig, Trainer

    out, batch, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    g = np.random.default_rng(0)
    data = TokenBatches(g.integers(0, 20, 3000).astype(np.uint16),
                        g.integers(0, 20, 600).astype(np.uint16), 16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, max_seq_len=16, dim=32, n_layers=2, n_heads=4))
    cfg = TrainConfig(out_dir=str(out), batch_size=batch, grad_accum=2, max_iters=steps,
                      lr=3e-3, min_lr=3e-4, warmup_iters=2, eval_interval=3, eval_iters=2,
                      dtype="fp32", compile=False, device="cpu", seed=1, optimizer="adamw")
    trainer = Trainer(model, cfg, data, out / f"rank{info.rank}", info)
    local = []
    step = trainer._train_step
    def recorded():
        loss = step()
        local.append(loss)
        return loss
    trainer._train_step = recorded
    result = trainer.fit()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(out / f"weights{info.rank}.safetensors"))
    (out / f"result{info.rank}.json").write_text(json.dumps({
        "world": info.world_size, "rank": info.rank, "local_losses": local,
        "best_val": result.best_val_loss, "last_train_loss": result.last_train_loss}))
    barrier(info)  # as qkv train: no rank tears its process group down while another still talks to it
    cleanup(info)
    """
)


def launch_all(cmds: list[list[str]], cwd: Path) -> None:
    """Run the commands side by side (their start-up dominates); each must exit 0."""
    procs = [subprocess.Popen(c, cwd=cwd, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    for cmd, proc in zip(cmds, procs, strict=True):
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(ddp, single): 2 processes x batch B, and 1 process x batch 2B."""
    root = tmp_path_factory.mktemp("ddp")
    script = root / "train_script.py"
    script.write_text(SCRIPT)
    ddp, single = root / "ddp", root / "single"
    launch_all([
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         str(script), str(ddp), str(B), str(STEPS)],
        [sys.executable, str(script), str(single), str(2 * B), str(STEPS)],
    ], root)
    return ddp, single


def result(d: Path, rank: int) -> dict:
    return json.loads((d / f"result{rank}.json").read_text())


def test_ddp_weights_match_one_process_with_the_global_batch(runs) -> None:
    ddp, single = runs
    assert result(ddp, 0)["world"] == result(ddp, 1)["world"] == 2
    assert result(single, 0)["world"] == 1
    ref = load_file(str(single / "weights0.safetensors"))
    for rank in (0, 1):  # both replicas, kept identical by DDP's all-reduce
        w = load_file(str(ddp / f"weights{rank}.safetensors"))
        assert w.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(w[name], ref[name], rtol=0, atol=1e-5, msg=f"{rank} {name}")
    # The final checkpoint rank 0 wrote holds the same weights (the tied matrix under either name).
    saved = load_file(str(ddp / "rank0" / "checkpoint" / "last.safetensors"))
    saved = {("tok_emb.weight" if k == "lm_head.weight" else k): t for k, t in saved.items()}
    assert saved.keys() == ref.keys()
    for name, t in saved.items():
        torch.testing.assert_close(t, ref[name], rtol=0, atol=1e-5, msg=name)


def test_ddp_shards_average_to_the_global_batch_loss(runs) -> None:
    ddp, single = runs
    r0, r1 = result(ddp, 0)["local_losses"], result(ddp, 1)["local_losses"]
    ref = result(single, 0)["local_losses"]
    assert len(r0) == len(r1) == len(ref) == STEPS
    for step, (a, b, want) in enumerate(zip(r0, r1, ref, strict=True)):
        assert (a + b) / 2 == pytest.approx(want, rel=0, abs=1e-5), step
        assert a != pytest.approx(b, abs=1e-4)  # the ranks really saw different rows


def test_ddp_validation_loss_matches(runs) -> None:
    ddp, single = runs
    val = {r["step"]: r["val_loss"] for r in metrics(ddp / "rank0") if r.get("val_loss") is not None}
    ref = {r["step"]: r["val_loss"] for r in metrics(single / "rank0") if r.get("val_loss") is not None}
    assert sorted(val) == sorted(ref) == [0, 3, 6]
    for step in ref:
        assert val[step] == pytest.approx(ref[step], rel=0, abs=1e-5), step
    assert result(ddp, 0)["best_val"] == pytest.approx(result(single, 0)["best_val"], abs=1e-5)


def test_ddp_logged_train_loss_is_the_global_batch_loss(runs) -> None:
    """metrics.jsonl (and the progress display) should show the loss of the whole global
    batch, as the equivalent single-process run does, not rank 0's half of it."""
    ddp, single = runs
    logged = {r["step"]: r["train_loss"] for r in metrics(ddp / "rank0") if "lr" in r}
    ref = {r["step"]: r["train_loss"] for r in metrics(single / "rank0") if "lr" in r}
    assert sorted(logged) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert logged[step] == pytest.approx(ref[step], rel=0, abs=1e-5), step


def test_only_rank_0_writes_files(runs) -> None:
    ddp, _ = runs
    assert {p.name for p in (ddp / "rank0").iterdir()} == {
        "checkpoint", "model.safetensors", "metrics.jsonl"}
    assert not (ddp / "rank1").exists()
    steps = [r["step"] for r in metrics(ddp / "rank0") if "lr" in r]
    assert steps == list(range(1, STEPS + 1))  # each step logged once


# --------------------------------------------------------------------------- single process


def test_single_process_helpers_are_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    info = init_distributed("cpu")
    assert info == DistInfo(device="cpu") and info.is_main and not info.enabled
    assert mean_across(2.5, info) == 2.5
    assert broadcast_flag(True, info) is True
