"""dflash-torch: DFlash block-diffusion speculative decoding for local LLMs, on PyTorch."""

from .decoding.sampling import Sampler
from .generate import Pipeline, Result, generate, load, prompt_logprobs, stream

__all__ = ["Pipeline", "Result", "Sampler", "generate", "load", "prompt_logprobs", "stream"]
__version__ = "0.1.0"
