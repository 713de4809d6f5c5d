"""HF transformers as both engines: the training forward and ``generate`` run the same modules.

:func:`install` puts rl_engine's operators into one model instance (reversible);
:func:`train_token_logprobs` scores sequences with gradients (training side);
:func:`generate_with_logprobs` samples and records each token's log-prob (rollout side).
Importing this package does not import transformers.
"""

from rl_engine.integrations.hf.install import HFInstall, InstallConflict, install, is_installed, logical_positions
from rl_engine.integrations.hf.rollout import Rollout, generate_with_logprobs
from rl_engine.integrations.hf.train import train_token_logprobs

__all__ = [
    "HFInstall",
    "InstallConflict",
    "Rollout",
    "generate_with_logprobs",
    "install",
    "is_installed",
    "logical_positions",
    "train_token_logprobs",
]
