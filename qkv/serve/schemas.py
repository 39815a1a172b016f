"""The JSON API's requests and responses (Pydantic models: they make /openapi.json)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

MAX_CHARS = 20_000  # the hard limit on a text field; tokens beyond the context are truncated


class ErrorMessage(BaseModel):
    """Every 4xx/5xx response: one sentence that names the problem and the fix."""

    detail: str


class ModelInfo(BaseModel):
    id: str = Field(description="what to send as `model`: a pretrained name or runs/NAME")
    family: str = Field(description="a pretrained model (minilm, smollm2) or the family of a run "
                        "(gpt, vit, seq2seq, captioner: see qkv.families)")
    kind: Literal["encoder", "decoder", "image", "seq2seq"] = Field(
        description="encoder: bidirectional self-attention; decoder: causal, can generate; "
        "image: takes an image upload; seq2seq: output x input alignment")
    input: Literal["text", "image"]
    can_generate: bool
    description: str


class ModelList(BaseModel):
    models: list[ModelInfo]
    runs_dir: str = Field(description="the folder runs are listed from")
    limits: dict[str, int] = Field(description="max_chars, max_tokens, max_new_tokens, max_upload_bytes")


class AttentionRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["minilm"])
    text: str = Field(max_length=MAX_CHARS, examples=["The cat sat on the mat because it was tired."])
    layer: int | None = Field(None, description="default: the last layer; negative counts from the end")
    head: int | None = Field(None, description="default (null): the mean over the layer's heads")


class AttentionResponse(BaseModel):
    model: str
    kind: str
    query_tokens: list[str] = Field(description="row labels (the tokens that attend)")
    key_tokens: list[str] = Field(description="column labels (the tokens attended to)")
    weights: list[list[float]] = Field(description="rows x columns; each row sums to 1")
    layer: int | None = Field(description="null for seq2seq alignments")
    head: int | None = Field(description="null: the mean over heads")
    n_layers: int
    n_heads: int
    causal: bool
    output: str | None = Field(None, description="seq2seq: the translation (the rows)")
    notes: list[str] = Field(description="what was changed about the input, e.g. truncation")
    seconds: float = Field(description="server time for this request")


class GenerateRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["smollm2"])
    prompt: str = Field(max_length=MAX_CHARS, examples=["Once upon a time"])
    max_new_tokens: int = Field(20, ge=1, le=512)
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy")
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None
    layer: int | None = Field(None, description="default: the last layer")
    head: int | None = Field(None, description="default (null): the mean over heads")


class GenerateEvent(BaseModel):
    """One line of the application/x-ndjson stream of POST /api/generate.

    ``start``: the prompt's tokens; ``token``: a new token with the attention (``weights``,
    one per earlier token) of the position that chose it; ``done``: the whole continuation;
    ``error``: generation stopped (the message says why).
    """

    event: Literal["start", "token", "done", "error"]
    tokens: list[str] | None = None
    token: str | None = None
    id: int | None = None
    weights: list[float] | None = None
    text: str | None = None
    layer: int | None = None
    head: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    notes: list[str] | None = None
    detail: str | None = None
    seconds: float | None = None


class ImagePixels(BaseModel):
    width: int
    height: int
    channels: int
    pixels: list[int] = Field(description="uint8, row-major, channels last (what the model saw)")


class ImageMap(BaseModel):
    label: str
    weights: list[list[float]] = Field(description="grid x grid, over the image")


class ImageAttentionResponse(BaseModel):
    model: str
    family: str
    title: str = Field(description="ViT: the prediction; captioner: the caption")
    image: ImagePixels
    grid: int
    maps: list[ImageMap]
    notes: list[str]
    details: dict[str, Any]
    seconds: float
