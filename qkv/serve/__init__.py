"""``qkv serve``: a local web page to explore attention, backed by a JSON API.

    from qkv.serve import create_app
    app = create_app(runs_dir="runs")      # a FastAPI app; `qkv serve` runs it with uvicorn

Needs the ``serve`` extra: ``pip install 'qkv[serve]'`` (FastAPI, uvicorn, python-multipart).
"""

from qkv.serve.app import create_app
from qkv.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]
