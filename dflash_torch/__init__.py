"""dflash-torch: DFlash block-diffusion speculative decoding for local LLMs, on PyTorch."""

from .generate import Pipeline, Result, generate, load, prompt_logprobs, stream
from .sampling import Sampler

__all__ = ["Pipeline", "Result", "Sampler", "generate", "load", "prompt_logprobs", "stream"]
__version__ = "0.1.0"
