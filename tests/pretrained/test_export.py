"""qkv export: runs trained here (the tiny preset, a few steps) exported and read back by
transformers itself, which shares no code with qkv's writer.

The logits of transformers' model on the export must equal qkv's on the run to 1e-5 (fp32),
greedy tokens must be the same, transformers' tokenizer must give qkv's ids on held text, and
qkv.load(OUT) must give back the run's logits. Bad inputs are one line, exit 2.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, call, call_one_thread
from torch import Tensor

import qkv
from qkv.families import get_family
from qkv.generation import generate
from qkv.models.gpt import GPTConfig
from qkv.pretrained.export import hf_architecture

transformers = pytest.importorskip("transformers", reason="reference package transformers not "
                                   "installed: pip install 'qkv[reference]'")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

HELD = "JULIET: what light?  O Romeo\nROMEO: \n\n"  # in the tiny text's alphabet, not a line of it
# Runs beside tiny_run("gpt") (learned positions, LayerNorm, exact GELU, no biases, tied, char):
# (extra `qkv train gpt --preset tiny` options, the architecture they export as)
VARIANTS = {
    "llama_gqa_bpe": (["--positions", "rope", "--norm", "rmsnorm", "--mlp", "swiglu", "--n_kv_heads", "2",
                       "--rope_theta", "500", "--tokenizer", "bpe", "--bpe_vocab_size", "300"], "llama"),
    "gpt2_bias_tanh_untied_bpe": (["--bias", "true", "--mlp", "gelu_tanh", "--tie_embeddings", "false",
                                   "--norm_eps", "1e-6", "--tokenizer", "bpe", "--bpe_vocab_size", "300"],
                                  "gpt2"),
    "llama_qkv_bias_char": (["--positions", "rope", "--norm", "rmsnorm", "--mlp", "swiglu",
                             "--qkv_bias", "true", "--tie_embeddings", "false"], "llama"),
}


def _train(root: Path, name: str, extra: list[str]) -> Path:
    run = root / name
    argv = ["train", "gpt", "--preset", "tiny", "--max_iters", "4", "--eval_iters", "1",
            "--data", str(root / "text.txt"), "--compile", "false", "--out_dir", str(run), "--no-progress",
            "--sample-tokens", "1", *extra]
    rc, out, err = call_one_thread(argv, root / "cache")
    assert rc == 0, out + err
    return run


@pytest.fixture(scope="module")
def runs(tiny_run, tmp_path_factory) -> dict[str, Path]:
    gpt = tiny_run("gpt")
    root = tmp_path_factory.mktemp("export-runs")
    import shutil

    shutil.copy(gpt.parent.parent / "text.txt", root / "text.txt")  # the tiny run's own text
    out = {"gpt2_char": gpt}
    out.update({name: _train(root, name, extra) for name, (extra, _) in VARIANTS.items()})
    return out


def _export(run: Path, out: Path, *extra: str) -> Path:
    rc, _, err = call(["export", str(run), "-o", str(out), *extra])
    assert rc == 0, err
    return out


def _silent(fn, *args, **kwargs):
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' loading progress bars
        return fn(*args, **kwargs)


@pytest.mark.parametrize("name", ["gpt2_char", *VARIANTS])
def test_export_hf_equals_transformers(runs, tmp_path: Path, name: str) -> None:
    run = runs[name]
    loaded = get_family("gpt").load(run)
    model, tok = loaded.model.eval(), loaded.tokenizer
    arch = VARIANTS[name][1] if name in VARIANTS else "gpt2"
    assert hf_architecture(model.cfg) == arch
    out = _export(run, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                    "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json"]
    assert not list(tmp_path.glob(".*tmp"))  # the temporary folder was renamed, none left
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] == model.cfg.tie_embeddings

    hf = _silent(transformers.AutoModelForCausalLM.from_pretrained, out).eval()
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]
    assert hf.dtype == torch.float32

    # the tokenizer: transformers' on held text gives qkv's ids, and decodes them back
    ids = tok.encode(HELD)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert fast(HELD)["input_ids"] == ids
    assert fast.decode(ids) == HELD
    assert _silent(transformers.AutoTokenizer.from_pretrained, out)(HELD)["input_ids"] == ids

    x = torch.tensor([ids[:20]])
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert ours.abs().max().item() > 0.1  # logits that say something

    n_new = model.cfg.max_seq_len - x.shape[1]
    qkv_tokens = [int(t[0]) for t in generate(model, x, n_new, temperature=0.0)]
    hf_tokens = hf.generate(x, max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, x.shape[1]:].tolist()
    assert qkv_tokens == hf_tokens

    # read back by qkv itself: the run's logits again, the same tokenizer ids
    back = _silent(qkv.load, str(out))
    assert back.tokenizer.encode(HELD) == ids
    with torch.no_grad():
        again = back.model(x).logits
    assert (again - ours).abs().max().item() <= 1e-5


def test_zero_biases_are_written_where_qkv_has_none(runs, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = _export(runs["gpt2_char"], tmp_path / "hf")  # bias=false: gpt2 still has biases
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["transformer.h.0.attn.c_attn.bias"].abs().max() == 0
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: (in, out)
    assert "lm_head.weight" not in tensors  # tied: transformers ties it back
    out = _export(runs["llama_qkv_bias_char"], tmp_path / "llama")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0  # trained
    assert tensors["model.layers.0.self_attn.o_proj.bias"].abs().max() == 0  # qkv has none there
    assert tensors["model.layers.0.mlp.gate_proj.bias"].abs().max() == 0


@pytest.mark.parametrize(("options", "names"), [
    (dict(positions="sinusoidal"), "--positions sinusoidal"),
    (dict(positions="alibi"), "--positions alibi"),
    (dict(positions="none"), "--positions none"),
    (dict(norm="rmsnorm"), "--norm rmsnorm with --positions learned"),
    (dict(mlp="swiglu"), "--mlp swiglu with --positions learned"),
    (dict(n_kv_heads=2), "--n_kv_heads 2"),
    (dict(head_dim=16), "--head_dim 16"),
    (dict(embed_scale=True), "--embed_scale"),
    (dict(positions="rope", norm="layernorm", mlp="swiglu"), "--norm layernorm with --positions rope"),
    (dict(positions="rope", norm="rmsnorm", mlp="gelu"), "--mlp gelu with --positions rope"),
    (dict(positions="rope", norm="rmsnorm", mlp="geglu_tanh"), "--mlp geglu_tanh"),
])
def test_options_without_a_counterpart_are_named(options: dict, names: str) -> None:
    cfg = GPTConfig(vocab_size=10, max_seq_len=8, dim=32, n_layers=1, n_heads=4, **options)
    with pytest.raises(ValueError, match="cannot export") as e:
        hf_architecture(cfg)
    assert names in str(e.value) and "\n" not in str(e.value)


def _variant_of(run: Path, root: Path, name: str = "variant", **model: object) -> Path:
    """A copy of ``run`` whose config.json asks for other GPTConfig options (fresh weights)."""
    import shutil

    from qkv.models.gpt import GPT
    from qkv.training import checkpoint as ckpt

    dst = root / name
    shutil.copytree(run, dst)
    saved = json.loads((dst / "config.json").read_text())
    saved["model"].update(model)
    (dst / "config.json").write_text(json.dumps(saved))
    ckpt.save_weights(GPT(GPTConfig(**saved["model"])), dst / "model.safetensors")
    return dst


def test_bad_inputs_are_one_line(runs, tiny_run, tmp_path: Path) -> None:
    vit = tiny_run("vit")
    rc, _, err = call(["export", str(vit), "-o", str(tmp_path / "a")])
    assert "vit run" in assert_one_line_error(rc, err)
    alibi = _variant_of(runs["gpt2_char"], tmp_path, positions="alibi")
    rc, _, err = call(["export", str(alibi), "-o", str(tmp_path / "b")])
    assert "--positions alibi" in assert_one_line_error(rc, err)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    rc, _, err = call(["export", str(runs["gpt2_char"]), "-o", str(tmp_path / "full")])
    assert "already exists" in assert_one_line_error(rc, err)
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    rc, _, err = call(["export", str(runs["gpt2_char"]), "--dtype", "q8_0", "-o", str(tmp_path / "c")])
    assert "--dtype q8_0 is for --format gguf" in assert_one_line_error(rc, err)
    rc, _, err = call(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "d")])
    assert "nope" in assert_one_line_error(rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "variant"]  # nothing else written


def test_an_empty_out_folder_is_filled(runs, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = _export(runs["gpt2_char"], tmp_path / "empty")
    assert (out / "model.safetensors").is_file()


def test_qkv_generate_reads_the_export_as_it_reads_the_run(runs, tmp_path: Path) -> None:
    out = _export(runs["llama_gqa_bpe"], tmp_path / "hf")
    texts = []
    for source in (runs["llama_gqa_bpe"], out):
        rc, stdout, err = call(["generate", str(source), "--prompt", "JULIET: O", "--temperature", "0",
                                "--max-new-tokens", "12"])
        assert rc == 0, err
        texts.append([line for line in stdout.splitlines() if line.startswith("JULIET: O")])
    assert texts[0] == texts[1] and len(texts[0]) == 1


def _run_that_ends(run: Path, root: Path) -> tuple[Path, list[int], list[int], int]:
    """A copy of the BPE ``run`` whose model chooses <|endoftext|> at the 5th greedy step after
    HELD: its output row w is solved (least squares over the final hidden states h_j of steps
    0..4) so that w·h_j is the step's best logit - 0.05 before step 4 and + 0.05 at it.
    Returns (copy, prompt ids, the greedy tokens before the stop, eos)."""
    import shutil

    from safetensors.torch import save_model

    from qkv.tokenizers import end_of_text_id

    copy = root / "ends"
    shutil.copytree(run, copy)
    loaded = get_family("gpt").load(copy)
    model, tok = loaded.model.eval(), loaded.tokenizer
    eos = end_of_text_id(tok)
    assert eos == tok.vocab_size - 1 == model.cfg.vocab_size - 1  # every BPE run qkv trains has one
    ids = tok.encode(HELD)[:10]
    x = torch.tensor([ids])
    before = [int(t[0]) for t in generate(model, x, 8, temperature=0.0)]
    assert eos not in before  # a run trained on a text without the marker never ends by itself
    k = 4
    seen: list[Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, inp, _o: seen.append(inp[0][0]))
    with torch.no_grad():
        best = model(torch.tensor([ids + before[:k]])).logits[0, len(ids) - 1:].amax(-1)
        hook.remove()
        h = seen[0][len(ids) - 1:].double()  # (k+1, dim): the states that choose steps 0..k
        target = best.double() + torch.tensor([-0.05] * k + [0.05], dtype=torch.float64)
        model.lm_head.weight[eos] = (torch.linalg.pinv(h) @ target).float()
    save_model(model, str(copy / "model.safetensors"))
    tokens = []
    for t in generate(model, x, 30, temperature=0.0):
        if int(t[0]) == eos:
            break
        tokens.append(int(t[0]))
    assert tokens == before[:k]  # it ends now, where it was made to
    return copy, ids, tokens, eos


def test_end_of_text_ends_generation_in_qkv_transformers_and_gguf(runs, tmp_path: Path) -> None:
    """<|endoftext|> travels: qkv generate stops at it; the HF export names it (config,
    generation_config, tokenizer_config) and transformers' generate stops at the same token; the
    GGUF names it as bos/eos (a control token) and both readers take it as the end."""
    run, ids, tokens, eos = _run_that_ends(runs["llama_gqa_bpe"], tmp_path)
    tok = get_family("gpt").load(run).tokenizer
    prompt = tok.decode(ids)
    rc, stdout, err = call(["generate", str(run), "--prompt", prompt, "--temperature", "0",
                            "--max-new-tokens", "30"])
    assert rc == 0, err
    assert stdout == prompt + tok.decode(tokens) + "\n"  # stopped at the end of text, not printed
    assert f"[{len(tokens)} tokens" in err

    out = _export(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    gen_config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == gen_config["eos_token_id"] == eos
    assert gen_config["max_length"] == 32 and gen_config["temperature"] == 0.8  # the tiny preset's context
    hf = _silent(transformers.AutoModelForCausalLM.from_pretrained, out).eval()
    assert hf.generation_config.eos_token_id == eos and hf.generation_config.top_k == 200
    hf_tok = _silent(transformers.AutoTokenizer.from_pretrained, out)
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == eos
    x = torch.tensor([ids])
    hf_tokens = hf.generate(x, do_sample=False, max_new_tokens=30, pad_token_id=eos)[0, len(ids):].tolist()
    assert hf_tokens == [*tokens, eos]  # transformers keeps the stop token; qkv does not print it
    assert _silent(qkv.load, str(out)).stop_ids == (eos,)

    out = _export(run, tmp_path / "gguf", "--format", "gguf")
    import gguf

    reader = gguf.GGUFReader(out / "model.gguf")
    field = reader.fields["tokenizer.ggml.eos_token_id"]
    assert int(field.parts[field.data[0]][0]) == eos
    types = reader.fields["tokenizer.ggml.token_type"]
    assert int(types.parts[types.data[eos]][0]) == 3  # a control token: never split, not printed
    hf = _silent(transformers.AutoModelForCausalLM.from_pretrained, out, gguf_file="model.gguf").eval()
    assert hf.generation_config.eos_token_id == eos
    hf_tokens = hf.generate(x, do_sample=False, max_new_tokens=30, pad_token_id=eos)[0, len(ids):].tolist()
    assert hf_tokens == [*tokens, eos]
    back = _silent(qkv.load, str(out / "model.gguf"), weights="fp32")
    assert back.stop_ids == (eos,) and back.tokenizer.encode("a<|endoftext|>") == [*tok.encode("a"), eos]


def test_a_run_without_an_end_of_text_says_so(runs, tmp_path: Path) -> None:
    rc, _, err = call(["export", str(runs["gpt2_char"]), "-o", str(tmp_path / "hf")])
    assert rc == 0 and "no end-of-text token (a character tokenizer)" in err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] is None
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] is None


def test_a_failed_export_leaves_nothing(runs, tmp_path: Path, monkeypatch) -> None:
    from qkv.pretrained import export

    def broken(model, tok, folder: Path) -> str:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_hf_folder", broken)
    rc, _, err = call(["export", str(runs["gpt2_char"]), "-o", str(tmp_path / "out")])
    assert "disk full" in assert_one_line_error(rc, err)
    assert list(tmp_path.iterdir()) == []  # neither OUT nor the temporary folder


def test_help_names_formats_dtypes_and_refusals() -> None:
    rc, out, _ = call(["export", "--help"])
    assert rc == 0
    for word in ("gpt2", "llama", "gguf", "q8_0", "bf16", "refused", "overwritten"):
        assert word in out, word


# --------------------------------------------------------------------------- GGUF

# dtype -> tolerance of transformers' logits on the GGUF against the run's (fp32) logits
GGUF_TOLERANCE = {"f32": 1e-5, "f16": 3e-3, "bf16": 3e-2, "q8_0": 3e-2, "q4_0": 0.5}


@pytest.mark.parametrize("dtype", GGUF_TOLERANCE)
def test_export_gguf_equals_transformers(runs, tmp_path: Path, dtype: str) -> None:
    gguf = pytest.importorskip("gguf")
    loaded = get_family("gpt").load(runs["llama_gqa_bpe"])
    model, tok = loaded.model.eval(), loaded.tokenizer
    out = _export(runs["llama_gqa_bpe"], tmp_path / "g", "--format", "gguf", "--dtype", dtype)
    assert [p.name for p in out.iterdir()] == ["model.gguf"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    assert types["blk.0.attn_norm.weight"] == "F32"  # norms stay f32, as llama.cpp writes them
    assert types["blk.0.attn_q.weight"] == {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0",
                                              "q4_0": "Q4_0"}[dtype]

    hf = _silent(transformers.AutoModelForCausalLM.from_pretrained, out, gguf_file="model.gguf").eval()
    hf_tok = _silent(transformers.AutoTokenizer.from_pretrained, out, gguf_file="model.gguf")
    ids = tok.encode(HELD)
    assert hf_tok(HELD)["input_ids"] == ids
    x = torch.tensor([ids[:20]])
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
    assert (ours - theirs).abs().max().item() <= GGUF_TOLERANCE[dtype]
    # qkv reads the file back (qkv.load(FILE.gguf), fp32 weights) as transformers does
    back = _silent(qkv.load, str(out / "model.gguf"), weights="fp32")
    assert back.tokenizer.encode(HELD) == ids
    with torch.no_grad():
        again = back.model(x).logits
    assert (again - theirs).abs().max().item() <= 1e-5
    if dtype == "f32":
        n_new = model.cfg.max_seq_len - x.shape[1]
        qkv_tokens = [int(t[0]) for t in generate(model, x, n_new, temperature=0.0)]
        hf_tokens = hf.generate(x, max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, x.shape[1]:].tolist()
        assert qkv_tokens == hf_tokens


def test_qkv_bias_exports_as_qwen2_gguf(runs, tmp_path: Path) -> None:
    """--qkv_bias true: llama.cpp's qwen2 (q/k/v biases, rows not permuted); transformers reads
    it as Qwen2 with the same logits and greedy tokens, and so does qkv.load."""
    from qkv.training import checkpoint as ckpt

    run = _variant_of(runs["llama_gqa_bpe"], tmp_path, "qwen2", qkv_bias=True)
    loaded = get_family("gpt").load(run)
    model, tok = loaded.model.eval(), loaded.tokenizer
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn.qkv.bias"):
                p.copy_(0.5 * torch.randn_like(p))  # biases that matter (they start at zero)
    ckpt.save_weights(model, run / "model.safetensors")
    out = _export(run, tmp_path / "g", "--format", "gguf")
    import gguf

    reader = gguf.GGUFReader(out / "model.gguf")
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen2"
    assert "blk.0.attn_q.bias" in {t.name for t in reader.tensors}
    hf = _silent(transformers.AutoModelForCausalLM.from_pretrained, out, gguf_file="model.gguf").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    x = torch.tensor([tok.encode(HELD)[:20]])
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
        no_bias = hf.model.layers[0].self_attn.q_proj.bias.abs().max().item()
    assert no_bias > 0.1 and (ours - theirs).abs().max().item() <= 1e-5
    n_new = model.cfg.max_seq_len - x.shape[1]
    qkv_tokens = [int(t[0]) for t in generate(model, x, n_new, temperature=0.0)]
    hf_tokens = hf.generate(x, max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, x.shape[1]:].tolist()
    assert qkv_tokens == hf_tokens
    back = _silent(qkv.load, str(out / "model.gguf"), weights="fp32")
    with torch.no_grad():
        assert (back.model(x).logits - ours).abs().max().item() <= 1e-5


def test_gpt2_style_exports_as_gpt2_gguf(runs, tmp_path: Path) -> None:
    """Learned positions + LayerNorm + tanh GELU: llama.cpp's gpt2 (fused attn_qkv, biases, the
    output head written). transformers reads it when the context is 1024 (its reader's limit):
    a 1024-token variant gives transformers' logits 1e-5 from qkv's and the same greedy tokens;
    the trained 32-token run reads back in qkv exactly."""
    import gguf

    run = runs["gpt2_bias_tanh_untied_bpe"]
    loaded = get_family("gpt").load(run)
    model, tok = loaded.model.eval(), loaded.tokenizer
    x = torch.tensor([tok.encode(HELD)[:20]])
    rc, _, err = call(["export", str(run), "--format", "gguf", "-o", str(tmp_path / "g")])
    assert rc == 0 and "note" not in err, err  # tanh GELU: nothing differs
    names = {t.name for t in gguf.GGUFReader(tmp_path / "g" / "model.gguf").tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_qkv.bias", "position_embd.weight", "output.weight"} <= names
    back = _silent(qkv.load, str(tmp_path / "g" / "model.gguf"), weights="fp32")
    with torch.no_grad():
        assert (back.model(x).logits - model(x).logits).abs().max().item() <= 1e-5

    long = _variant_of(run, tmp_path, "long", max_seq_len=1024)  # random weights, transformers' size
    model = get_family("gpt").load(long).model.eval()
    out = _export(long, tmp_path / "g1024", "--format", "gguf")
    hf = _silent(transformers.AutoModelForCausalLM.from_pretrained, out, gguf_file="model.gguf").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
    assert ours.abs().max().item() > 0.1 and (ours - theirs).abs().max().item() <= 1e-5
    qkv_tokens = [int(t[0]) for t in generate(model, x, 12, temperature=0.0)]
    hf_tokens = hf.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, x.shape[1]:].tolist()
    assert qkv_tokens == hf_tokens


def test_exact_gelu_is_written_with_a_note(runs, tmp_path: Path) -> None:
    """An exact-GELU gpt2-style run: the GGUF computes the tanh form (llama.cpp's gpt2), so its
    logits move a little, and the export says so."""
    run = _variant_of(runs["gpt2_bias_tanh_untied_bpe"], tmp_path, "exact", mlp="gelu")
    rc, _, err = call(["export", str(run), "--format", "gguf", "-o", str(tmp_path / "g")])
    assert rc == 0 and "note: llama.cpp's gpt2 computes GELU in its tanh form" in err
    loaded = get_family("gpt").load(run)
    x = torch.tensor([loaded.tokenizer.encode(HELD)[:20]])
    back = _silent(qkv.load, str(tmp_path / "g" / "model.gguf"), weights="fp32")
    with torch.no_grad():
        gap = (back.model(x).logits - loaded.model.eval()(x).logits).abs().max().item()
    assert 0 < gap < 1e-2


def test_permute_rope_rows_is_undone_by_the_reader() -> None:
    import numpy as np

    from qkv.pretrained.export_gguf import permute_rope_rows
    from qkv.pretrained.gguf_models import unpermute_rope_rows

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    p = permute_rope_rows(w, 4)
    assert not np.array_equal(p, w)
    assert np.array_equal(unpermute_rope_rows(p, 4), w)
    # head 0, D = 8: rows (0, 4, 1, 5, 2, 6, 3, 7), the pairs (x_i, x_{i+D/2}) side by side
    assert p[:8, 0].tolist() == [w[i, 0] for i in (0, 4, 1, 5, 2, 6, 3, 7)]


def test_gguf_refusals_are_one_line(runs, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    cases = [
        (runs["gpt2_char"], "a character tokenizer cannot be carried"),
        (_variant_of(runs["gpt2_bias_tanh_untied_bpe"], tmp_path, "relu", mlp="relu"), "--mlp relu"),
        (_variant_of(runs["llama_gqa_bpe"], tmp_path, "biased", bias=True), "--bias true"),
        (_variant_of(runs["gpt2_char"], tmp_path, "char_llama", positions="rope", norm="rmsnorm",
                     mlp="swiglu"), "a character tokenizer cannot be carried"),
    ]
    for i, (run, names) in enumerate(cases):
        rc, _, err = call(["export", str(run), "--format", "gguf", "-o", str(tmp_path / f"g{i}")])
        assert names in assert_one_line_error(rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["biased", "char_llama", "relu"]  # nothing written


def test_out_ending_in_gguf_is_the_file_itself(runs, tmp_path: Path) -> None:
    """`-o model.gguf` writes that file (as llama.cpp's converter's --outfile does), byte for byte
    the file a folder export holds; it never overwrites, and an HF export refuses the name."""
    run = runs["llama_gqa_bpe"]
    folder = _export(run, tmp_path / "g", "--format", "gguf")
    rc, out, err = call(["export", str(run), "--format", "gguf", "-o", str(tmp_path / "model.gguf")])
    assert rc == 0, err
    assert (tmp_path / "model.gguf").is_file() and str(tmp_path / "model.gguf") in out
    assert (tmp_path / "model.gguf").read_bytes() == (folder / "model.gguf").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    (tmp_path / "mine.gguf").write_bytes(b"mine")
    rc, _, err = call(["export", str(run), "--format", "gguf", "-o", str(tmp_path / "mine.gguf")])
    assert "already exists" in assert_one_line_error(rc, err)
    assert (tmp_path / "mine.gguf").read_bytes() == b"mine"
    rc, _, err = call(["export", str(run), "-o", str(tmp_path / "x.gguf")])
    assert "a Hugging Face export is a folder" in assert_one_line_error(rc, err)
    assert not (tmp_path / "x.gguf").exists()
