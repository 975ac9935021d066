"""The service behind the Tinker API: sessions, and one training model on trainer ranks at a time.

The requests of a training model run one at a time in the order of their `seq_id` (the SDK numbers them
and sends several at once: a forward_backward and the optim_step after it); one refused on arrival keeps
its place, so the ones after it still run. Gradients accumulate over forward_backward calls until
optim_step, and nothing else steps or zeroes them. `save_weights_for_sampler` refits the engines
(molt/tinker/sampling.py); a forward after it scores the engines' own tokens, and the trainer/engine gap
on them is returned with the forward and logged with the step (invariant 3).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tinker import types

from molt.algo import datum_loss, gap_metrics
from molt.driver.metrics import RunLogger
from molt.spec import RunSpec
from molt.spec.model import LoRASpec
from molt.tinker import Refused
from molt.tinker.datums import check_datums, datum_logprobs, trainer_batch
from molt.tinker.sampling import Engines
from molt.tinker.wire import ForwardBackward, write_forward_backward_output
from molt.trainer.ranks import TrainerRanks

SESSION_TIMEOUT_S = 120.0   # a session without a heartbeat this long is over (the SDK beats every 10 s)
# LoRA targets of the client's train_* flags (Qwen / Llama module names; '*' matches the layer path)
LORA_TARGETS = {"train_attn": ["*q_proj", "*k_proj", "*v_proj", "*o_proj"],
                "train_mlp": ["*gate_proj", "*up_proj", "*down_proj"], "train_unembed": ["lm_head"]}
Work = Callable[[], Awaitable[Any]]


@dataclass
class Model:
    """The training model: its trainer ranks, the order its requests run in, and its step's state."""
    id: str
    session: str
    lora: types.LoraConfig
    spec: RunSpec                                            # its trainer ranks'
    trainer: TrainerRanks
    next_seq: int = 1                                        # the seq_id that runs next
    pending: dict[int, tuple[Work | None, asyncio.Future | None]] = field(default_factory=dict)
    runner: asyncio.Task | None = None
    synced: bool = False        # the engines hold exactly this model's weights
    steps: int = 0              # optim_steps taken
    sums: dict[str, float] = field(default_factory=dict)   # since the last optim_step: its log line


def lora_spec(spec: RunSpec, lora: types.LoraConfig) -> LoRASpec:
    """The trainer's `model.lora` for a client's LoRA config (rank 0: full fine-tuning), refit merged so
    that the engines serve it as full weights whatever it adapts."""
    flags = {k: getattr(lora, k) for k in LORA_TARGETS}
    if lora.rank == 0:
        if not all(flags.values()):
            off = [k for k, v in flags.items() if not v]
            raise Refused(f"rank=0 (full fine-tuning) trains every weight; {off[0]}=False cannot be honored")
        return LoRASpec()
    if not any(flags.values()):
        raise Refused("a LoRA with train_mlp, train_attn and train_unembed all False adapts nothing")
    targets = [p for k, on in flags.items() if on for p in LORA_TARGETS[k]]
    return spec.model.lora.model_copy(update={"rank": lora.rank, "target_modules": targets,
                                              "refit": "merged"})


class Service:
    def __init__(self, spec: RunSpec, engines: Engines, config: Any, pad_id: int | None,
                 logger: RunLogger) -> None:
        """`spec`: the served spec (the engines' and, with the client's LoRA, the trainers'); `config`: the
        model's Hugging Face config; `pad_id`: its tokenizer's pad token."""
        self.spec, self.engines, self.logger = spec, engines, logger
        self.fleet, self.futures, self.base_model = engines.fleet, engines.futures, engines.base_model
        self.arch, self.vocab = config.architectures[0], config.get_text_config().vocab_size
        self.pad_id = pad_id if pad_id is not None else 0
        self.checkpoints = Path(spec.run.dir) / "checkpoints"
        self.sessions: dict[str, float] = {}                 # session id -> its last heartbeat
        self.model: Model | None = None
        self.starting: str | None = None                     # a model whose trainer ranks are starting
        # The ranks of the last model released, kept for a model made from a checkpoint with the same
        # spec: the load sets every weight and the optimizer, so nothing of the last model stays.
        self.idle: tuple[RunSpec, TrainerRanks] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None   # the HTTP server's, where all of this runs

    # -- sessions -----------------------------------------------------------------------------------------
    def create_session(self) -> str:
        session = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[session] = time.monotonic()
        return session

    def heartbeat(self, session: str) -> None:
        if session not in self.sessions:
            raise Refused(f"session {session} is unknown or over")
        self.sessions[session] = time.monotonic()

    async def finish(self, session: str) -> None:
        self.sessions.pop(session, None)
        if self.model is not None and self.model.session == session:
            await self.close_model()

    async def expire_sessions(self) -> None:
        """Forever: end the sessions whose client stopped beating (their model is released)."""
        while True:
            await asyncio.sleep(SESSION_TIMEOUT_S / 4)
            for session, seen in list(self.sessions.items()):
                if time.monotonic() - seen > SESSION_TIMEOUT_S:
                    print(f"molt.tinker: session {session} sent no heartbeat for {SESSION_TIMEOUT_S:g} s: "
                          "ended", flush=True)
                    await self.finish(session)

    async def close_model(self) -> None:
        """Release the training model; its trainer ranks stay, idle, for a model made from a checkpoint."""
        model, self.model = self.model, None
        if model.runner is not None:
            model.runner.cancel()
        for _, future in model.pending.values():   # queued behind the released model: they never run
            if future is not None:
                future.set_exception(Refused(f"model {model.id} was released before this request ran"))
        await self.stop_idle()
        self.idle = (model.spec, model.trainer)

    async def close(self) -> None:
        """The service's end: every trainer rank stops and the log is closed (the engines are the fleet's)."""
        if self.model is not None:
            await self.close_model()
        await self.stop_idle()
        self.logger.close()

    async def stop_idle(self) -> None:
        if self.idle is not None:
            trainer, self.idle = self.idle[1], None
            await asyncio.to_thread(trainer.shutdown)

    # -- the order of a model's requests ------------------------------------------------------------------
    def submit(self, model_id: str, seq_id: int, work: Work, check: Callable[[], None] = lambda: None) -> str:
        """Queue a model's request behind every earlier seq_id once `check` (its arrival checks) passes;
        returns its request id. A refused request keeps its place, so the ones after it still run."""
        model = self._model(model_id)
        if seq_id < model.next_seq or seq_id in model.pending:
            raise Refused(f"seq_id {seq_id} of model {model.id} was already used")
        try:
            check()
        except Refused:
            model.pending[seq_id] = (None, None)
            self._drain_soon(model)
            raise
        request_id, future = self.futures.new()
        model.pending[seq_id] = (work, future)
        self._drain_soon(model)
        return request_id

    def _drain_soon(self, model: Model) -> None:
        if model.runner is None or model.runner.done():
            model.runner = asyncio.get_running_loop().create_task(self._drain(model))

    async def _drain(self, model: Model) -> None:
        while model.next_seq in model.pending:
            work, future = model.pending.pop(model.next_seq)
            model.next_seq += 1
            if work is None:
                continue
            try:
                future.set_result(await work())
            except Exception as err:   # noqa: BLE001 - the request's failure is its future's; the model goes on
                future.set_exception(err)

    # -- training models ----------------------------------------------------------------------------------
    def _model(self, model_id: str) -> Model:
        if self.model is None or self.model.id != model_id:
            raise Refused(f"model {model_id} is not this service's training model (released, or never made)")
        return self.model

    def _check_base_model(self, base_model: str | None) -> None:
        if base_model not in (None, self.base_model):
            raise Refused(f"base_model={base_model!r} is not served; this service serves {self.base_model!r}")

    def _new_model(self, session: str, model_seq_id: int) -> str:
        if session not in self.sessions:
            raise Refused(f"session {session} is unknown or over")
        live = self.model.id if self.model is not None else self.starting
        if live is not None:
            raise Refused(f"one training model at a time (multi-tenant LoRA is not served): model {live} is "
                          "live; close its ServiceClient (or let its session expire) first")
        self.starting = f"{session}:train:{model_seq_id}"   # the id the SDK derives too
        return self.starting

    async def _start_trainer(self, model_id: str, session: str, lora: types.LoraConfig,
                             loading: bool = False) -> Model:
        """The model's trainer ranks: new ones, or, when a checkpoint is `loading` into them, the idle ranks
        of the last model if they were built from the same spec."""
        spec = self.spec.model_copy(deep=True)
        spec.model.lora = lora_spec(self.spec, lora)
        spec.run.seed = self.spec.run.seed if lora.seed is None else lora.seed
        try:
            if loading and self.idle is not None and self.idle[0] == spec:
                trainer, self.idle = self.idle[1], None
            else:
                await self.stop_idle()
                trainer = await asyncio.to_thread(TrainerRanks, spec, "policy")
        finally:
            self.starting = None
        self.model = Model(model_id, session, lora, spec, trainer)
        await self.fleet.connect(trainer)   # the refit group to the engines, ready for the first refit
        return self.model

    def create_model(self, request: types.CreateModelRequest) -> str:
        self._check_base_model(request.base_model)
        if not isinstance(request.optimizer_config, types.AdamOptimizerConfig):
            raise Refused(f"optimizer_config type {request.optimizer_config.type!r} is not served (adamw is)")
        lora = request.lora_config or types.LoraConfig(rank=0)
        lora_spec(self.spec, lora)   # its refusals, now
        model_id = self._new_model(request.session_id, request.model_seq_id)

        async def create() -> types.CreateModelResponse:
            await self._start_trainer(model_id, request.session_id, lora)
            return types.CreateModelResponse(model_id=model_id)
        return self.futures.start(create())

    def info(self, model_id: str) -> types.GetInfoResponse:
        model = self._model(model_id)
        return types.GetInfoResponse(
            model_data=types.ModelData(arch=self.arch, model_name=self.base_model,
                                       tokenizer_id=self.base_model),
            model_id=model_id, is_lora=model.lora.rank > 0, lora_rank=model.lora.rank or None,
            model_name=self.base_model)

    # -- forward / backward and the optimizer --------------------------------------------------------------
    def forward_backward(self, request: ForwardBackward) -> str:
        def check() -> None:
            try:
                datum_loss(request.loss_fn, request.config)
            except ValueError as err:
                raise Refused(str(err)) from None
            check_datums(request.data, request.loss_fn, self.vocab)
        return self.submit(request.model_id, request.seq_id, lambda: self._forward_backward(request), check)

    async def _forward_backward(self, request: ForwardBackward) -> bytes:
        model = self.model
        sampled = self.engines.sampled   # the engines' own tokens, if they hold this model's weights
        current = [sampled.mark(d) if model.synced else np.zeros(len(d.tokens), bool) for d in request.data]
        batch = trainer_batch(request.data, self.pad_id, current)
        t0 = time.perf_counter()
        async with self.fleet.trainer:
            logprobs, sums = await asyncio.to_thread(model.trainer.accumulate, batch, request.loss_fn,
                                                     request.config, not request.forward_only)
        # the step's log line (at optim_step): the loss it trains on, the gap wherever it was measured
        step = {f"time/{'forward' if request.forward_only else 'forward_backward'}": time.perf_counter() - t0,
                **{k: v for k, v in sums.items() if k.startswith("mismatch/")}}
        if not request.forward_only:
            step["loss"] = sums["loss"]
        for name, value in step.items():
            merged = max if name == "mismatch/max_abs" else (lambda a, b: a + b)
            model.sums[name] = merged(model.sums.get(name, 0.0), value)
        metrics = {"loss:sum": sums["loss"], **{f"{k}:{'max' if k.endswith('max_abs') else 'sum'}": v
                                                for k, v in sums.items() if k.startswith("mismatch/")}}
        return write_forward_backward_output(datum_logprobs(logprobs, request.data), metrics)

    def optim_step(self, request: types.OptimStepRequest) -> str:
        adam = request.optim_params
        if not isinstance(adam, types.AdamParams):
            raise Refused(f"optimizer params of type {getattr(adam, 'type', type(adam).__name__)!r} are not "
                          "served (AdamParams are)")
        return self.submit(request.model_id, request.seq_id or 0, lambda: self._optim_step(adam))

    async def _optim_step(self, adam: types.AdamParams) -> types.OptimStepResponse:
        model = self.model
        t0 = time.perf_counter()
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        async with self.fleet.trainer:
            norm = await asyncio.to_thread(model.trainer.apply_gradients, adam.learning_rate,
                                           (adam.beta1, adam.beta2), adam.eps, adam.weight_decay, max_norm)
        model.steps += 1
        model.synced = False
        sums, model.sums = model.sums, {}
        metrics = {"train/grad_norm": norm, "train/lr": adam.learning_rate,
                   "train/loss": sums.pop("loss", 0.0), "time/optim_step": time.perf_counter() - t0,
                   "policy/version": float(self.engines.version)}
        metrics.update({k: v for k, v in sums.items() if k.startswith("time/")})
        if sums.get("mismatch/tokens"):   # invariant 3 on the engines' own tokens, as the loop logs it
            metrics.update(gap_metrics({k[len("mismatch/"):]: v for k, v in sums.items()
                                        if k.startswith("mismatch/")}))
        self.logger.log(model.steps, metrics)
        return types.OptimStepResponse(metrics=metrics)

    # -- weights ------------------------------------------------------------------------------------------
    def _path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        """A checkpoint's tinker:// path and its folder (kind: weights | sampler_weights)."""
        for part in (model_id, name):   # both become folder names under run.dir/checkpoints
            if not part or "/" in part or part.startswith("."):
                raise Refused(f"checkpoint name {part!r}: non-empty, without '/', not starting with '.'")
        local = self.checkpoints / model_id.replace(":", "_") / kind / name
        return f"tinker://{model_id}/{kind}/{name}", local

    def _state(self, path: str) -> Path:
        """The folder of a training state's tinker:// path, which must exist."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
            raise Refused(f"{path!r} is not a training state's path (tinker://<model>/weights/<name>)")
        local = self._path(parts[0], "weights", parts[2])[1]
        if not local.exists():
            raise Refused(f"{path!r}: no such training state in {self.checkpoints}")
        return local

    def save_state(self, request: types.SaveWeightsRequest) -> str:
        path, local = self._path(request.model_id, "weights", request.path or f"state-{uuid.uuid4().hex[:8]}")

        def check() -> None:
            if local.exists() and not request.overwrite:
                raise Refused(f"checkpoint {path} exists (save with overwrite=True to replace it)")
        return self.submit(request.model_id, request.seq_id or 0, lambda: self._save_state(path, local),
                           check)

    async def _save_state(self, path: str, local: Path) -> types.SaveWeightsResponse:
        model = self.model
        extra = {"base_model": self.base_model, "lora": model.lora.model_dump(), "model_id": model.id}
        async with self.fleet.trainer:
            await asyncio.to_thread(model.trainer.save, str(local), extra)
        return types.SaveWeightsResponse(path=path)

    def load_state(self, request: types.LoadWeightsRequest) -> str:
        """Into the live model (model_id + seq_id: the deprecated load_state*), or into a new model made
        from the checkpoint (session_id + model_seq_id: create_training_client_from_state*)."""
        if request.weights_access_token:
            raise Refused("weights_access_token is not served: checkpoints are this service's own")
        local = self._state(request.path)
        meta = torch.load(local / "meta.pt", weights_only=False)["extra"]
        if request.model_id is not None:
            model = self._model(request.model_id)
            if meta["lora"] != model.lora.model_dump():
                raise Refused(f"{request.path} was saved with LoRA {meta['lora']}; the model has "
                              f"{model.lora.model_dump()}")
            return self.submit(model.id, request.seq_id or 0,
                               lambda: self._load_state(local, request.optimizer, request.path))
        self._check_base_model(request.base_model or meta["base_model"])
        if request.optimizer_config is not None and request.optimizer:
            raise Refused("optimizer_config with optimizer=True: the checkpoint's optimizer is restored")
        model_id = self._new_model(request.session_id, request.model_seq_id)

        async def create_and_load() -> types.LoadWeightsResponse:
            await self._start_trainer(model_id, request.session_id, types.LoraConfig(**meta["lora"]),
                                      loading=True)
            return await self._load_state(local, request.optimizer, request.path)
        return self.futures.start(create_and_load())

    async def _load_state(self, local: Path, optimizer: bool, path: str) -> types.LoadWeightsResponse:
        model = self.model
        async with self.fleet.trainer:
            await asyncio.to_thread(model.trainer.load, str(local), not optimizer)
        model.synced = False
        return types.LoadWeightsResponse(path=path, model_id=model.id)

    def save_for_sampler(self, request: types.SaveWeightsForSamplerRequest) -> str:
        """A refit of the engines to the model's weights as a new policy version; named, also the merged
        weights on disk as a Hugging Face folder (its tinker:// path is the sampler weights')."""
        path, local = self._path(request.model_id, "sampler_weights", request.path) if request.path else \
            (None, None)

        def check() -> None:
            if local is not None and local.exists():
                raise Refused(f"sampler weights {path} exist")
        return self.submit(request.model_id, request.seq_id or 0,
                           lambda: self._save_for_sampler(path, local, request.kind), check)

    async def _save_for_sampler(self, path: str | None, local: Path | None,
                                kind: str) -> types.SaveWeightsForSamplerResponseInternal:
        model = self.model
        if local is not None:
            async with self.fleet.trainer:
                await asyncio.to_thread(model.trainer.export_hf, str(local))
        seconds = await self.engines.refit(model.id)
        model.synced = True
        model.sums["time/refit"] = model.sums.get("time/refit", 0.0) + seconds
        if path is not None:
            self.engines.paths[path] = self.engines.version
            return types.SaveWeightsForSamplerResponseInternal(path=path)
        version = None if kind == "inflight" else self.engines.version
        sampler = self.engines.new_sampler(None, version, model.id)
        return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler.id)
