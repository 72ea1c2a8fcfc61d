"""adaptive_spec: exact speculative decoding with trainable adaptive drafting (SpecDec++).

Data flows one way: prompts -> datagen -> training -> acceptance head -> decoder -> sweep -> report.
"""
from .backends.models import CausalLM, load_model
from .decoding.decoder import Decoder, Generation, Metrics
from .decoding.interfaces import DraftStep, RoundOwner, RoundState, StopPolicy, register
from .decoding.pipeline import SpecPair, make_policy, policy_names
from .decoding.policies import FixedK
from .decoding.sampling import SamplingParams
from .errors import UserError

__all__ = ["CausalLM", "Decoder", "DraftStep", "FixedK", "Generation", "Metrics", "RoundOwner", "RoundState",
           "SamplingParams", "SpecPair", "StopPolicy", "UserError", "load_model", "make_policy", "policy_names",
           "register"]
