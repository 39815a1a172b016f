"""qkv: attention and Transformers from first principles.

Layout (data flows one way): attention/ (all attention math) -> layers/ (norms, MLPs,
Transformer blocks) -> models -> training -> generation / visualisation. See DESIGN.md.
"""

__version__ = "0.1.0"
