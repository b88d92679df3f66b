"""The optional fast CPU path: fp32 models on a packed linear kernel and lean C++ decoder layers.

Model loading calls its one entry point, `apply_fast_path`; nothing else in the library imports
this package, and without it every model runs on transformers' stock layers. Its results do not
depend on how many tokens share a forward, so plain and speculative decoding give the same bits.
Once loaded, its extension also serves the runtime's top candidates and retrieval's draft search
(the same drafts, bit for bit, as retrieval's Python search).
"""

from .extension import FastPathUnavailable
from .fast_path import FastPath, apply_fast_path, prepare, prepare_integer_forms

__all__ = ["FastPath", "FastPathUnavailable", "apply_fast_path", "prepare", "prepare_integer_forms"]
