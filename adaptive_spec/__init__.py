"""adaptive_spec: exact speculative decoding with trainable adaptive drafting (SpecDec++).

Data flows one way: prompts -> datagen -> training -> acceptance head -> decoder -> sweep -> report.
"""
from .decoding import Decoder, Generation, Metrics
from .errors import UserError
from .models import CausalLM, load_model
from .pipeline import SpecPair
from .policies import DraftStep, FixedK, StopPolicy, make_policy
from .sampling import SamplingParams

__all__ = ["CausalLM", "Decoder", "DraftStep", "FixedK", "Generation", "Metrics", "SamplingParams",
           "SpecPair", "StopPolicy", "UserError", "load_model", "make_policy"]
