"""Bad input across every subcommand: each case must end with exit code 2 and one line on
stderr that names the problem (the substring given), no traceback, and leave every file of
the existing runs exactly as it was (DESIGN.md: a user error never loses data)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = "the cat sat on the mat " * 2000  # ~12,000 SmolLM2 tokens: more than its 8,192 context
FITS = "the cat sat on the mat " * 1000  # ~6,000: within the context, its attention maps too large

# (argv with {gpt} {vit} {seq2seq} {captioner} {file} {root} {image} {notimage}, what the line names)
CASES: list[tuple[str, str]] = [
    # train
    ("train|--resume|{file}", "not a directory; give the run directory"),
    ("train|--preset|tiny|--out_dir|{file}/run", "Not a directory"),
    ("train|--preset|tiny|--device|foo", "--device 'foo' is not a device"),
    ("train|--preset|tiny|--device|meta", "not on meta"),
    ("train|--resume|{gpt}", "has finished"),
    ("train|--resume|{root}/nope", "nope"),
    ("train|--preset|tiny|--data|{root}/nope.txt", "nope.txt"),
    ("train|--preset|tiny|--data|{root}", "a directory"),
    ("train|--preset|tiny|--max_iters|-1", "max_iters"),
    ("train|--preset|tiny|--lr|-1", "lr"),
    ("train|--preset|tiny|--batch_size|0", "batch_size"),
    ("train|--preset|nope", "nope"),
    ("train|gpt|--resume|{vit}", "vit run"),
    ("train|--resume|{gpt}|--dim|64", "only training fields can change"),
    ("train|seq2seq|--preset|tiny|--task|copy|--data|{file}", "--task copy"),
    ("train|seq2seq|--preset|tiny|--task|copy|--min_len|0", "min_len"),
    ("train|seq2seq|--preset|tiny|--task|copy|--max_len|100000", "max_len"),
    ("train|captioner|--preset|tiny|--data|{root}/nope", "nope"),
    ("train|vit|--preset|tiny|--dataset|nope", "nope"),
    # learn
    ("learn|start|nope", "no exercise 'nope'"),
    ("learn|run|hardmax|{file}", "has no model to run in"),
    ("docs|-o|{file}|--no-serve", "is a file, not a folder"),
    ("learn|check|softmax|{root}/nope.py", "is not a file"),
    ("learn|check|softmax|{file}", "defines no function softmax"),
    ("learn|hint|attention", "did you mean"),
    ("learn|start|softmax|--dir|{file}", "is a file, not a folder"),
    # prepare
    ("prepare|{root}/nope", "nope"),
    ("prepare|{vit}", "only decoders have decoding steps"),
    ("prepare|{gpt}|--threads|0", "--threads must be >= 1"),
    ("prepare|{gpt}|--max-tokens|4", "--max-tokens >= 8"),
    ("prepare|{gpt}|--weights|q4", "weights q4 decodes from a file's own 4-bit groups"),
    # generate
    ("generate|{gpt}|--device|foo", "--device 'foo' is not a device"),
    ("generate|{gpt}|--device|meta", "not on meta"),
    ("generate|{gpt}|--temperature|1e-45", "--temperature must be 0 (greedy) or a finite number >= 1e-06"),
    ("generate|{gpt}|--temperature|nan", "--temperature must be 0 (greedy) or a finite number"),
    ("generate|{gpt}|--temperature|-1", "--temperature must be 0"),
    ("generate|{gpt}|--top-k|-3", "--top-k must be >= 0"),
    ("generate|{gpt}|--top-p|1.5", "--top-p must be in (0, 1]"),
    ("generate|{gpt}|--max-new-tokens|-1", "--max-new-tokens must be >= 0"),
    ("generate|{root}/nope", "nope"),
    ("generate|{vit}", "vit run"),
    ("export|{vit}|--format|hf|-o|{root}/out", "vit run"),
    ("generate|{file}", "not a directory"),
    ("generate|{gpt}|--prompt|日本", "never saw"),
    ("generate|smollm2|--max-new-tokens|5", "give --prompt TEXT"),
    ("generate|{t5}|--prompt|hi", "t5"),  # a Hugging Face folder of an architecture qkv lacks
    ("attend|{t5}|hi", "t5"),
    # embed / similarity
    ("embed|minilm|--file|{file}/x", "Not a directory"),
    ("embed|minilm|--file|{root}/nope.txt", "nope.txt"),
    ("embed|minilm|--batch-size|0|hi", "batch"),
    ("similarity|minilm|q|{root}/nope.txt", "nope.txt"),
    ("similarity|minilm|q|a|b|--batch-size|0", "batch_size must be >= 1"),
    # classify / translate / caption
    ("classify|{vit}|{root}/nope.png", "nope.png"),
    ("classify|{vit}|{notimage}", "not a readable image"),
    ("classify|{gpt}|{image}", "gpt"),
    ("classify|{vit}|{image}|--top|0", "--top"),
    ("translate|{gpt}|hello", "gpt"),
    ("translate|{seq2seq}|x|--beam|0", "--beam"),
    ("caption|{captioner}|{root}/nope.png", "nope.png"),
    ("caption|{gpt}|{image}", "gpt"),
    # attend
    ("attend|{gpt}|hello|--layer|99", "--layer"),
    ("attend|{root}/nope|hello", "nope"),
    ("attend|{gpt}|hello|-o|{file}/x.png", "is a file, not a folder"),
    ("attend|smollm2|" + LONG + "|--max-tokens|8192", "more than smollm2's context of 8192"),  # as lens
    ("attend|smollm2|" + FITS + "|--max-tokens|8192", "GB (30 layers x 9 heads x"),
    # lens
    ("lens|{gpt}|hello|--ablate|9.9", "head 9.9 is not in"),
    ("lens|{gpt}|hello|--patch|--corrupt|hi", "same number of tokens"),
    ("lens|{gpt}|hello|--attribute|ROM", "must be one token"),
    ("lens|{vit}|hello", "the lens reads text models"),
    ("lens|{gpt}|hello|-o|{file}/x.svg", "is a file, not a folder"),
    # explain / serve / assets / bench
    ("explain|equivariance|--tokens|200000", "640.0 GB of float64 scores"),
    ("explain|equivariance|--dim|1000000", "tokens and dim must be at most 4096"),
    ("serve|--port|99999", "port"),
    ("serve|--runs|{file}", "is a file, not a folder of run directories"),
    ("assets|install|nope", "nope"),
    ("bench|nope", "nope"),
]
if not torch.cuda.is_available():  # this machine (and CI) has no GPU: asking for one is an error
    CASES += [("train|--preset|tiny|--device|cuda", "this machine has no CUDA GPU"),
              ("generate|{gpt}|--device|cuda:1", "this machine has no CUDA GPU")]
if not torch.backends.mps.is_available():
    CASES += [("train|--preset|tiny|--device|mps", "no Apple GPU")]


@pytest.fixture(scope="module")
def places(tiny_run, tmp_path_factory) -> dict[str, str]:
    from PIL import Image

    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "afile.txt").write_text("hello\n", encoding="utf-8")
    (root / "notimage.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.new("RGB", (28, 28), (200, 40, 40)).save(root / "image.png")
    (root / "t5").mkdir()
    (root / "t5" / "config.json").write_text('{"model_type": "t5", "d_model": 8}', encoding="utf-8")
    runs = {f: str(tiny_run(f)) for f in ("gpt", "vit", "seq2seq", "captioner")}
    return {**runs, "file": str(root / "afile.txt"), "root": str(root), "image": str(root / "image.png"),
            "t5": str(root / "t5"),
            "notimage": str(root / "notimage.png")}


def test_there_are_at_least_40_cases_over_every_subcommand() -> None:
    from qkv.cli import build_parser

    commands = {c.split("|")[0] for c, _ in CASES}
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert len(CASES) >= 40 and commands == set(sub.choices)


@pytest.mark.parametrize(("case", "names"), CASES, ids=[c[:60] for c, _ in CASES])
def test_bad_input_is_one_line_and_changes_nothing(places, case: str, names: str) -> None:
    if "smollm2" in case or "minilm" in case:
        from pretrained.asset_skip import require_asset

        require_asset("smollm2" if "smollm2" in case else "minilm")
    runs_root = Path(places["gpt"]).parent
    before = snapshot(runs_root)
    argv = [a.format(**places) for a in case.split("|")]
    rc, _, err = call(argv)
    line = assert_one_line_error(rc, err) if not err.startswith("usage:") else _argparse_line(rc, err)
    assert names in line, line
    assert snapshot(runs_root) == before  # no file of any existing run changed, none added


def _argparse_line(rc: int, err: str) -> str:
    """argparse's own errors print the usage, then one 'error:' line; exit 2, no traceback."""
    assert rc == 2 and "Traceback" not in err, err
    return [x for x in err.splitlines() if "error:" in x][-1]


def test_training_on_a_text_without_a_newline_ends_well(tmp_path: Path) -> None:
    """The end-of-run sample starts from a character of the text (it has no newline to start
    from) and the hint after it suggests a prompt the run can read."""
    text = tmp_path / "notes.txt"
    text.write_text("abc abd abe " * 60, encoding="utf-8")
    run = tmp_path / "run"
    rc, out, err = call(["train", "--preset", "tiny", "--data", str(text), "--out_dir", str(run),
                         "--max_iters", "4", "--compile", "false", "--no-progress"])
    assert rc == 0, err
    hint = out.strip().splitlines()[-1]
    assert hint == f"generate more: qkv generate {run} --prompt abc"
    rc, gen, err = call(["generate", str(run), "--prompt", "abc", "--max-new-tokens", "5", "--seed", "0"])
    assert rc == 0 and gen.startswith("abc") and set(gen.split("\n")[0]) <= set("abcde "), err
    rc, gen, err = call(["generate", str(run), "--max-new-tokens", "5", "--seed", "0"])  # default prompt
    assert rc == 0 and gen[0] in "abde ", err  # the sample starts from a character of the text


def test_every_rank_gets_its_own_gpu(monkeypatch) -> None:
    """Under torchrun, --device cuda (or auto) means this rank's GPU, not GPU 0 for all; an
    index beyond the GPUs there is refused in one line (4 GPUs faked)."""
    from qkv.device import check_device
    from qkv.training.distributed import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [pick_device("cuda", r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert pick_device("auto", 3) == "cuda:3" and pick_device("cpu", 3) == "cpu"
    assert pick_device("cuda:1", 3) == "cuda:1"  # an explicit index is the user's choice
    with pytest.raises(ValueError, match=r"cuda:5: this machine has 4 CUDA GPU\(s\), cuda:0 to cuda:3"):
        check_device("cuda:5")
