"""specdecode: lossless speculative decoding behind one engine."""

from .api import Result, SpecDecoder
from .drafters import DRAFTERS, Drafter, register
from .engine import Stats, decode, generate
from .errors import SpecDecodeError
from .sampling import SamplingParams
from .tree import Draft

__all__ = [
    "DRAFTERS", "Draft", "Drafter", "Result", "SamplingParams", "SpecDecodeError", "SpecDecoder", "Stats",
    "decode", "generate", "register",
]
