"""The JSON API's requests and responses (Pydantic models: they make /openapi.json)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from qkv.generation.sampling import MIN_TEMPERATURE

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
    runs_dir: str = Field(description="the name of the folder runs are listed from (never a full path)")
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
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy, else at least 1e-6")
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1, description="a 64-bit seed (null: random)")
    layer: int | None = Field(None, description="default: the last layer")
    head: int | None = Field(None, description="default (null): the mean over heads")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        # logits / 1e-300 overflow to inf and sampling would fail after the status line went out
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value:g}")
        return value


class ComputeEvent(BaseModel):
    """One line of the application/x-ndjson stream a lens, knock-out, q·k or patching
    request gets when it sends ``Accept: application/x-ndjson`` (the page does): where it stands
    while it waits, then its answer. Closing the stream stops the computation (unless another
    client waits for the same one).

    ``queued``: ``position`` is its place in the server's fair queue (1: next); ``running``:
    started (a patching sweep adds ``done`` of ``total`` forward passes); ``result``: ``result``
    is the response the plain request gets; ``error``: ``status`` is the HTTP status the plain
    request gets, ``detail`` its message, ``retry_after`` (a 503) its Retry-After.
    """

    event: Literal["queued", "running", "result", "error"]
    position: int | None = None
    done: int | None = None
    total: int | None = None
    result: dict[str, Any] | None = None
    status: int | None = None
    detail: str | None = None
    retry_after: int | None = None


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


class LensRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["smollm2"])
    text: str = Field(max_length=MAX_CHARS, examples=["The capital of France is"])
    ablate: list[tuple[int, int]] = Field(default_factory=list, max_length=4096,
                                          description="heads to knock out, as [layer, head] pairs")
    mode: Literal["zero", "mean"] = Field("zero", description="replace an ablated head by zero or its mean")
    thumbs: bool = Field(True, description="also send every head's pattern as a small thumbnail")


class TokenCandidate(BaseModel):
    id: int
    token: str


class LogitLensCells(BaseModel):
    rows: list[str] = Field(description="embed, then the stream after each block")
    positions: list[int] = Field(description="the token positions read out (the last 16)")
    top: list[list[str]] = Field(description="rows x positions: the top token of each cell")
    prob: list[list[float]] = Field(description="its probability")


class RolloutCells(BaseModel):
    positions: list[int] = Field(description="the query positions (rows), the last 32 at most")
    values: list[list[float]] = Field(description="rows x every token: how much of that position's "
                                      "output comes from each input token through every layer (attention "
                                      "rollout, Abnar & Zuidema 2020; heads averaged, residual share 0.5; "
                                      "rows sum to 1)")


class LensResponse(BaseModel):
    model: str
    kind: str
    tokens: list[str]
    n_layers: int
    n_heads: int
    ablated: list[tuple[int, int]]
    logits: list[float] | None = Field(None, description="decoders: the next-token logits (full vocabulary) "
                                       "with the ablated heads knocked out; softmax(logits / T) are the "
                                       "probabilities at temperature T")
    base_logits: list[float] | None = Field(None, description="the same without ablation (null when "
                                            "nothing is ablated)")
    candidates: list[TokenCandidate] = Field(description="the most likely next tokens by logit (their order "
                                             "is the same at every temperature)")
    lens: LogitLensCells | None = None
    thumbs: list[list[list[float]]] | None = Field(None, description="layer-major (L·H) small patterns, "
                                                   "average-pooled to at most 16 x 16")
    scores: dict[str, list[list[float]]] = Field(description="head scores (L x H) per type: previous, first, "
                                                 "duplicate, induction")
    labels: list[list[str]]
    threshold: float = Field(description="a head is named after its highest score when that reaches this "
                             "(qkv.lens.NAMED_AT, the same in the terminal)")
    rollout: RolloutCells | None = None
    embedding_change: float | None = Field(None, description="encoders: 1 - cos of the sentence embedding "
                                           "with and without the ablated heads")
    notes: list[str]
    seconds: float


class QKRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["smollm2"])
    text: str = Field(max_length=MAX_CHARS, examples=["The capital of France is"])
    layer: int = Field(description="negative counts from the end")
    head: int = Field(description="negative counts from the end")
    query: int = Field(-1, description="the query token's position (negative counts from the end)")


class QKResponse(BaseModel):
    model: str
    layer: int
    head: int
    query: int
    query_token: str
    keys: list[str] = Field(description="the keys the query may attend to (up to the query when causal)")
    dots: list[float] = Field(description="q·k for each key, after RoPE where the model uses it")
    scaled: list[float] = Field(description="q·k / √d (+ ALiBi's bias where the model has one)")
    weights: list[float] = Field(description="softmax(scaled): the head's attention row")
    head_dim: int
    seconds: float


class PatchRequest(BaseModel):
    """Activation patching of ``clean`` into ``corrupt`` (decoders; same number of tokens).

    ``method`` "estimate" (the default: it answers first) is attribution patching
    (:func:`qkv.lens.attribution_patch`): every cell from two forward passes and one backward
    pass, a fraction of a second, on float weights only (a quantised model answers 422).
    "exact" is the sweep (:func:`qkv.lens.patch`), a forward pass per cell, run in pieces
    (streamed progress with ``Accept: application/x-ndjson``); with ``compare`` it also holds
    the estimate and how well the two agree (:func:`qkv.lens.agreement`).
    """

    model: str = Field(min_length=1, max_length=256, examples=["smollm2"])
    clean: str = Field(max_length=MAX_CHARS)
    corrupt: str = Field(max_length=MAX_CHARS)
    site: Literal["resid", "head"] = "head"
    answer: str | None = Field(None, max_length=256, description="one token (default: the clean top token)")
    wrong: str | None = Field(None, max_length=256, description="one token (default: the corrupt top token)")
    method: Literal["estimate", "exact"] = Field(
        "estimate", description="estimate: attribution patching (two forward passes and one backward pass, "
        "float weights only); exact: one forward pass per cell, in pieces")
    compare: bool = Field(False, description="with method exact: also the estimate, and how well the two "
                          "agree")

    @model_validator(mode="after")
    def _compare_is_exact(self) -> PatchRequest:
        if self.compare and self.method != "exact":
            raise ValueError('compare puts the exact sweep beside the estimate: send method "exact" with it')
        return self


class PatchAgreement(BaseModel):
    """How the estimate ranks the cells against the exact sweep (:func:`qkv.lens.agreement`)."""

    spearman: float | None = Field(description="Spearman's rank correlation of the two tables (null: "
                                   "undefined, e.g. a table of equal values)")
    recall: float = Field(description="of the exact sweep's k largest cells by |value|, the share among the "
                          "estimate's k largest")
    k: int


class PatchResponse(BaseModel):
    model: str
    method: Literal["estimate", "exact"] = Field(description="what ``values`` holds")
    site: str
    rows: list[str]
    columns: list[str]
    values: list[list[float | None]] = Field(description="0 = as corrupt, 1 = as clean (null: undefined)")
    answer: str
    wrong: str
    clean_diff: float
    corrupt_diff: float
    estimate: list[list[float | None]] | None = Field(
        None, description="compare: the estimate's values beside the exact ``values`` (null otherwise)")
    estimate_seconds: float | None = Field(
        None, description="the estimate's own time (two forward passes and one backward pass); null for a "
        "plain exact sweep")
    agreement: PatchAgreement | None = Field(None, description="compare: the estimate against the sweep")
    saturated: list[list[int]] = Field(
        default_factory=list,
        description="with an estimate: heads (layer, head) whose attention is saturated in the corrupt "
        "run (a row's largest weight >= 0.99 on the last row or on half the rows), where an effect "
        "through them can be missed to first order (Kramar et al. 2024)")
    seconds: float = Field(description="server time for this request")


class HistoryRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, examples=["runs/gpt-cpu"])


class HistoryResponse(BaseModel):
    model: str
    steps: list[int] = Field(description="the evaluations recorded")
    scores: dict[str, list[list[list[float]]]] = Field(description="per head type: steps x layers x heads")
    loss_first: list[float] = Field(description="loss on the first copy of the repeated probe, per step")
    loss_second: list[float] = Field(description="loss on the repeated copy, per step")
    formed: dict[str, int | None] = Field(description="the step each head type's best head reached 0.5")
    copying: int | None = Field(description="the step the repeat's loss fell 0.5 nats below the first copy's")
