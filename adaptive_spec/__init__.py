"""adaptive_spec: exact speculative decoding with trainable adaptive drafting (SpecDec++).

Data flows one way: prompts -> datagen -> training -> acceptance head -> decoder -> sweep -> report.
"""
from .backends.models import CausalLM, load_model
from .heads.head import AcceptanceHead, load_head
from .decoding.decoder import Decoder, Generation, Metrics
from .decoding.interfaces import DraftStep, RoundOwner, RoundState, StopPolicy, register
from .decoding.pipeline import SpecPair, make_policy, policy_names
from .decoding.ngram import NgramPolicy
from .decoding.policies import FixedK, LearnedThreshold
from .decoding.sampling import SamplingParams
from .errors import UserError

__all__ = ["AcceptanceHead", "CausalLM", "Decoder", "DraftStep", "FixedK", "Generation", "LearnedThreshold", "Metrics",
           "NgramPolicy", "RoundOwner", "RoundState", "SamplingParams", "SpecPair", "StopPolicy", "UserError", "load_head",
           "load_model", "make_policy", "policy_names", "register"]
