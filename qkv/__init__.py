"""qkv: attention and Transformers from first principles.

Layout (data flows one way): attention/ (all attention math) -> layers/ (norms, MLPs,
Transformer blocks) -> models -> training -> generation / visualisation. See DESIGN.md.
"""

__version__ = "0.1.0"


def load(name: str, **kwargs):
    """A pretrained model by name ("minilm", "smollm2") or a Hugging Face checkpoint folder by
    its path (llama, mistral, qwen2, gemma, gpt2, bert): see :func:`qkv.pretrained.load`."""
    from qkv.pretrained import load as _load

    return _load(name, **kwargs)
