"""The decoding core: the drafter, the speculative loop, acceptance and sampling, prompt lookup, the adaptive
block size, structured output, the target-only fallback, caches kept between turns."""
