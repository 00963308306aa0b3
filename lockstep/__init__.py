"""lockstep: reinforcement-learning post-training of mixture-of-experts language models.

The trainer and the rollout engine share one model definition (`lockstep.models`) so the
log-probability a token was sampled with and the one it is trained with can agree exactly.
"""

__version__ = "0.1.0"
