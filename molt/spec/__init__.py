"""The run spec: every key, its default and its rules, one file per section (model.py, parallel.py,
rollout.py, algo.py, train.py, agent.py, data.py, logging.py; run.py: the run and ray sections and RunSpec;
rules.py: the rules across sections). The names the rest of Molt imports are gathered here:
`from molt.spec import RunSpec, SpecError, ...`."""

from molt.spec.agent import AgentSpec, JudgeSpec
from molt.spec.algo import AlgoSpec, CorrectionSpec, FilterSpec, KLSpec, LossSpec, RewardSpec
from molt.spec.data import DataSpec, HubDataset, eval_names, pass_ks
from molt.spec.logging import LoggingSpec, WandbSpec
from molt.spec.model import LoRASpec, ModelSpec
from molt.spec.parallel import ParallelSpec
from molt.spec.rollout import GREEDY_BELOW, LOGPROBS_MODE, EngineSpec, EvalSamplingSpec, RolloutSpec
from molt.spec.rules import spec_warnings
from molt.spec.run import RaySpec, RunSection, RunSpec, SpecError, unknown_key_message, validate_spec
from molt.spec.strict import Strict
from molt.spec.train import TrainSpec

__all__ = [
    "GREEDY_BELOW", "LOGPROBS_MODE", "AgentSpec", "AlgoSpec", "CorrectionSpec", "DataSpec", "EngineSpec",
    "FilterSpec", "HubDataset", "JudgeSpec", "KLSpec", "LoRASpec", "LoggingSpec", "LossSpec", "ModelSpec",
    "ParallelSpec", "RaySpec", "RewardSpec", "RolloutSpec", "RunSection", "RunSpec", "EvalSamplingSpec",
    "SpecError", "Strict", "TrainSpec", "WandbSpec", "eval_names", "pass_ks", "spec_warnings",
    "unknown_key_message", "validate_spec",
]
