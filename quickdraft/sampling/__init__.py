"""Sampling parameters, logits processing and token selection."""
from quickdraft.sampling.dry import sequence_breakers
from quickdraft.sampling.params import SamplingParams
from quickdraft.sampling.processors import LogitsProcessor, vocabulary_inputs
from quickdraft.sampling.structured import StructuredOutputs
from quickdraft.sampling.sampler import greedy, make_generator, sample, top_logprobs

__all__ = ["SamplingParams", "StructuredOutputs", "LogitsProcessor", "greedy", "make_generator", "sample",
           "top_logprobs", "sequence_breakers", "vocabulary_inputs"]
