"""The run spec: every key, its default and its rules. The sections live by topic in this folder; the
names every part of Molt imports (`from molt.spec import RunSpec, SpecError, ...`) are gathered here."""

from molt.spec.run import (  # noqa: F401  (re-exported: the spec's public names)
    GREEDY_BELOW,
    LOGPROBS_MODE,
    AgentSpec,
    AlgoSpec,
    CorrectionSpec,
    DataSpec,
    EngineSpec,
    HubDataset,
    JudgeSpec,
    KLSpec,
    LoRASpec,
    LossSpec,
    ModelSpec,
    RolloutSpec,
    RunSpec,
    SpecError,
    Strict,
    eval_names,
    pass_ks,
    spec_warnings,
    unknown_key_message,
    validate_spec,
)
