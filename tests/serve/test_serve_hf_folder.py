"""A Hugging Face checkpoint folder inside the runs directory is served like a run: listed,
its attention equal to `transformers`' own, and a shard linked from outside refused."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import call, dev_package, save_hf_folder, tiny_hf_decoder

transformers = dev_package("transformers")
tokenizers = dev_package("tokenizers")


def _qwen2_folder(folder: Path):
    """tests/helpers.py's tiny Qwen2 in a checkpoint folder, its attention eager (to return weights)."""
    ref = tiny_hf_decoder("qwen2")
    ref.config._attn_implementation = "eager"
    save_hf_folder(ref, folder)
    return ref


def test_a_hugging_face_folder_is_served(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    runs = tmp_path / "runs"
    ref = _qwen2_folder(runs / "tiny-qwen2")
    c = TestClient(create_app(runs_dir=runs))
    listed = {m["id"]: m for m in c.get("/api/models").json()["models"]}
    assert listed["runs/tiny-qwen2"]["kind"] == "decoder"
    r = c.post("/api/attention", json={"model": "runs/tiny-qwen2", "text": "w3 w17 w42 w5 w9", "layer": 1,
                                       "head": 2})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        want = ref(torch.tensor([[3, 17, 42, 5, 9]]), output_attentions=True).attentions[1][0, 2]
    torch.testing.assert_close(torch.tensor(r.json()["weights"]), want, rtol=0, atol=1e-5)
    r = c.post("/api/generate", json={"model": "runs/tiny-qwen2", "prompt": "w3 w17", "max_new_tokens": 3})
    events = [json.loads(line) for line in r.text.splitlines()]
    assert r.status_code == 200
    assert [e["event"] for e in events] == ["start", "token", "token", "token", "done"]


def test_a_shard_linked_from_outside_the_runs_directory_is_refused(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from qkv.serve import create_app

    outside = tmp_path / "outside"
    _qwen2_folder(outside)
    runs = tmp_path / "runs"
    (runs / "linked").mkdir(parents=True)
    for f in outside.iterdir():  # config.json a real file, the weights a link out of the runs dir
        target = runs / "linked" / f.name
        if f.name == "model.safetensors":
            target.symlink_to(f)
        else:
            target.write_bytes(f.read_bytes())
    c = TestClient(create_app(runs_dir=runs))
    assert "runs/linked" not in {m["id"] for m in c.get("/api/models").json()["models"]}
    r = c.post("/api/attention", json={"model": "runs/linked", "text": "w1 w2"})
    assert r.status_code == 400 and "points outside the runs directory" in r.json()["detail"]


def test_a_gguf_file_in_the_runs_directory_is_served(tmp_path: Path) -> None:
    """A .gguf (written as llama.cpp does) beside the runs: listed, and its attention equals
    transformers' of the model it was written from; one linked from outside is refused."""
    from fastapi.testclient import TestClient

    dev_package("gguf")
    from pretrained.gguf_writing import write_decoder_gguf

    from qkv.serve import create_app

    runs = tmp_path / "runs"
    runs.mkdir()
    ref = tiny_hf_decoder("qwen2")
    ref.config._attn_implementation = "eager"
    write_decoder_gguf(ref, "qwen2", runs / "tiny.gguf")
    write_decoder_gguf(ref, "qwen2", tmp_path / "outside.gguf")
    (runs / "linked.gguf").symlink_to(tmp_path / "outside.gguf")
    c = TestClient(create_app(runs_dir=runs))
    ids = {m["id"]: m["kind"] for m in c.get("/api/models").json()["models"]}
    assert ids.get("runs/tiny.gguf") == "decoder" and "runs/linked.gguf" not in ids
    r = c.post("/api/attention", json={"model": "runs/tiny.gguf", "text": "w0w0 w0", "layer": 0, "head": 1})
    assert r.status_code == 200, r.text
    import qkv

    ids = qkv.load(str(runs / "tiny.gguf"), weights="fp32").tokenizer.encode("w0w0 w0")
    with torch.no_grad():
        want = ref(torch.tensor([ids]), output_attentions=True).attentions[0][0, 1]
    torch.testing.assert_close(torch.tensor(r.json()["weights"]), want, rtol=0, atol=1e-5)
    r = c.post("/api/attention", json={"model": "runs/linked.gguf", "text": "w0"})
    assert r.status_code == 400 and "points outside the runs directory" in r.json()["detail"]


def test_a_bert_gguf_is_served_and_attended_as_an_encoder(tmp_path: Path) -> None:
    """A bert .gguf (llama.cpp's converter's layout) is an encoder wherever a model is named:
    `qkv serve` lists it as one and its attention equals transformers' BertModel's eager
    attentions of the same weights; `qkv attend FILE.gguf` draws it."""
    from fastapi.testclient import TestClient

    dev_package("gguf")
    from pretrained.gguf_writing import bert_reference, write_bert_gguf

    from qkv.serve import create_app

    ref, tok, folder = bert_reference(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    write_bert_gguf(ref, tok, folder, runs / "bert.gguf")
    c = TestClient(create_app(runs_dir=runs))
    kinds = {m["id"]: m["kind"] for m in c.get("/api/models").json()["models"]}
    assert kinds["runs/bert.gguf"] == "encoder"
    text = "the cat sat on the mat"
    r = c.post("/api/attention", json={"model": "runs/bert.gguf", "text": text, "layer": 1, "head": 3})
    assert r.status_code == 200, r.text
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        want = ref(**tok(text, return_tensors="pt"), output_attentions=True).attentions[1][0, 3]
    torch.testing.assert_close(torch.tensor(r.json()["weights"]), want, rtol=0, atol=1e-5)
    rc, out, err = call(["attend", str(runs / "bert.gguf"), text, "-o", str(tmp_path / "a.png")])
    assert rc == 0, err
    assert (tmp_path / "a.png").stat().st_size > 0 and "8 tokens" in out  # [CLS] 6 words [SEP]
