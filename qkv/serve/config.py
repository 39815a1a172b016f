"""The server's settings: limits and places (``qkv serve``'s options fill one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qkv.serve.schemas import MAX_CHARS


@dataclass
class ServeConfig:
    """Limits and places. Every limit answers with a 4xx JSON message when crossed, except
    ``max_tokens``, beyond which text is truncated with a note."""

    runs_dir: Path = Path("runs")
    max_tokens: int = 256  # longest text a request shows (and never more than the model's context)
    max_chars: int = MAX_CHARS  # longest text accepted at all (422 beyond)
    max_new_tokens: int = 128  # most tokens one /api/generate request may ask for
    max_upload_bytes: int = 5_000_000  # largest image upload (413 beyond)
    max_pixels: int = 25_000_000  # largest image, width x height (413 beyond)
    max_loaded_models: int = 4  # models in memory at once, those being loaded included
    cache_bytes: int = 256 * 2**20  # recent attention results, so switching head is instant
    shared_answers: int = 64  # recent lens, q·k and patching answers kept for identical requests
    max_queued: int = 32  # computations waiting for the compute loop, and generations waiting for
    # a row of a model's running batch; 503 (Retry-After) beyond
    max_wait_s: float = 30.0  # longest a request waits to start, then 503
    batch_rows: int = 8  # generation requests decoded together per model (1: one at a time)
    host: str | None = None  # the address the server listens on (None: each connection's own)
    # Host headers accepted ("*.example.com" for subdomains); None: on a loopback address
    # loopback names only (DNS rebinding), on any other address any name
    allowed_hosts: Sequence[str] | None = field(default=None)
    # how decoders' weights are held, as qkv.load's weights=: "auto" (a 4-bit file as q4 where the
    # int4 kernels run), or "fp32" / "bf16" (gradients: the page's patching estimate), "int8", "q4"
    weights: str = "auto"

    def longest(self, context: int) -> int:
        """The most tokens a request's text and new tokens take together on a model of
        ``context`` positions: also the cache length of that model's running batch (and so of
        the saved step ``qkv serve --build-steps`` builds for it)."""
        return min(self.max_tokens, context)

    def __post_init__(self) -> None:
        self.runs_dir = Path(self.runs_dir)
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if self.max_upload_bytes < 1:
            raise ValueError(f"max upload size must be positive, got {self.max_upload_bytes} bytes")
        if self.shared_answers < 0:
            raise ValueError(f"shared_answers must be >= 0, got {self.shared_answers}")
        for name in ("max_loaded_models", "batch_rows", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        from qkv.pipelines.text import WEIGHTS

        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
