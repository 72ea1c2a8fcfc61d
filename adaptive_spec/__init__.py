"""adaptive_spec: exact speculative decoding with trainable adaptive drafting (SpecDec++).

Data flows one way: prompts -> datagen -> training -> acceptance head -> decoder -> sweep -> report.
"""
from .decoding import Decoder, Generation, Metrics
from .errors import UserError
from .interfaces import DraftStep, RoundOwner, RoundState, StopPolicy, register
from .models import CausalLM, load_model
from .pipeline import SpecPair, make_policy, policy_names
from .policies import FixedK
from .sampling import SamplingParams

__all__ = ["CausalLM", "Decoder", "DraftStep", "FixedK", "Generation", "Metrics", "RoundOwner", "RoundState",
           "SamplingParams", "SpecPair", "StopPolicy", "UserError", "load_model", "make_policy", "policy_names",
           "register"]
