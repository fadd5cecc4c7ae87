"""Sampling parameters, logits processing and token selection."""
from quickdraft.sampling.params import SamplingParams
from quickdraft.sampling.processors import LogitsProcessor
from quickdraft.sampling.sampler import greedy, make_generator, sample, top_logprobs

__all__ = ["SamplingParams", "LogitsProcessor", "greedy", "make_generator", "sample", "top_logprobs"]
