"""One trainer rank: a Ray actor that owns a shard of one role's model (policy, reference or critic).

`TrainerRanks` starts one per rank; together they form one torch.distributed group (gloo on CPU, NCCL
on GPU). Every public method here is collective: the group calls it on all ranks at once with each
rank's row shard of the batch, and rank 0's return value is the group's answer.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from molt import refit
from molt.algo import (
    LOSS_NORMS,
    datum_loss,
    load_plugins,
    loss_normalizer,
    policy_loss,
    sft_loss,
    value_loss,
)
from molt.spec import AlgoSpec, RunSpec
from molt.trainer import rank_state, weights
from molt.trainer.batch import RECORDED_SAMPLING, inert_rows, model_inputs, next_token_fields
from molt.trainer.context_parallel import Shard, split
from molt.trainer.fp8 import checkpoint_fp8
from molt.trainer.model import (
    DTYPES,
    autocast_dtype,
    build_model,
    chunk_tokens,
    chunkable,
    chunked_next_token_logprobs,
    distributed_setup,
    head_input,
    next_token_logprobs,
    shared_chunk_count,
    to_tokens,
)
from molt.trainer.offload import HostStateAdamW
from molt.trainer.packing import pack, token_budget_groups, unpack
from molt.trainer.router_replay import set_routes
from molt.trainer.schedule import lr_factor
from molt.trainer.step_metrics import StepMetrics
from molt.trainer.threads import RankThreads
from molt.trainer.token_record import TokenRecord
from molt.trainer.tower import sharded_tower, tower_in_every_forward

IMAGE_KEYS = ("pixel_values", "image_grid_thw")   # per row, but not per token (molt.trainer.batch)


class TrainerWorker:
    def __init__(self, spec: RunSpec, role: str, rank: int, path: str) -> None:
        self.spec = spec   # this rank's own copy (Ray pickles it): the SFT switch below stays here
        self.path = path   # the role's weights, resolved by the driver (molt.plan.models)
        load_plugins(self.spec)   # this process's loss registry must hold the spec's names too
        self.role, self.rank = role, rank
        self.cuda = self.spec.parallel.device == "cuda"
        # model.dtype is autocast over fp32 weights wherever FSDP2's mixed-precision cast does not apply
        # (CPU; CUDA at world size 1, where AutoModel does not shard): None when FSDP2 casts, or fp32.
        self.autocast = autocast_dtype(self.spec)
        self.sft = self.spec.train.objective == "sft"
        # The distribution a token is scored under when its batch row does not record the one it was sampled
        # from: the run's sampling; SFT scores the model's own distribution (nothing was sampled).
        r = self.spec.rollout
        self.scoring = (1.0, 1.0, -1) if self.sft else (r.temperature, r.top_p, r.top_k)
        self.threads = RankThreads(self.spec, role, rank)   # CPU: follows set_engines_idle
        self.step = 0
        self.refit_group: dist.ProcessGroup | None = None   # rank 0: the group to the engine workers
        self.refit_store: dist.TCPStore | None = None        # rank 0: where the next group meets
        self.store: dist.TCPStore | None = None              # rank 0: where the ranks meet (`address`)
        self.record: TokenRecord | None = None   # the last update's per-token record (update(record=True))
        self.cp_group: dist.ProcessGroup | None = None       # the ranks splitting each micro-batch (`setup`)
        self.image_token: int | None = None                  # a VLM's image placeholder id (`setup`)

    @ray.method(concurrency_group="control")   # runs while `update` holds the default group
    def set_engines_idle(self, idle: bool) -> None:
        self.threads.engines_idle = idle

    def address(self) -> tuple[str, int]:
        """Rank 0: listen for the ranks' rendezvous on a port the OS assigns as it binds (a port found free
        and bound later can be taken meanwhile: `molt.refit.listen`); returns this node's IP and the port."""
        par = self.spec.parallel
        self.store = dist.TCPStore(ray.util.get_node_ip_address(), 0, par.world_size, is_master=True,
                                   timeout=par.collective_timeout, wait_for_workers=False)
        return ray.util.get_node_ip_address(), self.store.port

    def setup(self, host: str, port: int) -> None:
        par = self.spec.parallel
        if self.cuda:
            torch.cuda.set_device(0)  # Ray gives each rank actor exactly one visible GPU
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(par.world_size), LOCAL_RANK="0")
        store = self.store if self.rank == 0 else dist.TCPStore(host, port, par.world_size, is_master=False,
                                                                timeout=par.collective_timeout)
        dist.init_process_group("nccl" if self.cuda else "gloo", store=store, rank=self.rank,
                                world_size=par.world_size, timeout=par.collective_timeout)
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        torch.manual_seed(self.spec.run.seed)
        setup = distributed_setup(self.spec)
        self.mesh = setup.mesh_context.device_mesh
        # the refit's format (block FP8: molt/trainer/fp8.py), read first: one it cannot reproduce stops the
        # run here
        self.fp8 = None if self.role != "policy" or self.spec.model.lora.served_as_adapter() else \
            checkpoint_fp8(self.path)
        self.model = build_model(self.spec, self.role, self.path, setup)
        self.threads.follow_blocks(self.model)
        self.image_token = getattr(self.model.config, "image_token_id", None)   # VLMs only
        self.tower_collectives = self.image_token is not None and sharded_tower(self.model)
        if self.image_token is not None and self.spec.train.micro_batch_tokens is not None:
            raise ValueError("train.micro_batch_tokens (sequence packing) does not pack image inputs yet: "
                             "use train.micro_batch_size with a vision-language model")
        if self.image_token is not None and par.cp_size > 1:
            raise ValueError("parallel.cp_size > 1 does not split image inputs over the cp ranks: use "
                             "cp_size=1 with a vision-language model")
        # context parallel: the ranks that split each micro-batch's positions (`_forward`)
        self.cp_group = self.mesh["cp"].get_group() if par.cp_size > 1 else None
        # The loss is already a global SUM / global normalizer per rank, so FSDP must sum gradients
        # across data shards instead of averaging them. Gloo has no pre-multiplied sum: force plain sums.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(not self.cuda)
        self.optimizer, self.scheduler = None, None
        if self.role != "reference":
            params = [p for p in self.model.parameters() if p.requires_grad]
            lr = self.spec.train.critic_lr if self.role == "critic" else self.spec.train.lr
            adamw = HostStateAdamW if self.spec.parallel.offload == "optimizer" else torch.optim.AdamW
            self.optimizer = adamw(params, lr=lr, betas=self.spec.train.betas,
                                   weight_decay=self.spec.train.weight_decay)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                               lambda s: lr_factor(self.spec, self.role, s))
            # AutoModel's training utilities import torch's compiler (≈2 s): imported here, while the
            # engines start, not in the first train step, nor at the top of this module, which the
            # driver imports for the actor class.
            from nemo_automodel.components.distributed.tp_replicas import synchronize_tp_replica_gradients
            from nemo_automodel.components.training.utils import clip_grad_norm
            # TE's grouped experts carry no EP axis on their own mesh: the EP mesh reduces their norm
            moe = setup.mesh_context.moe_mesh if self.spec.parallel.ep_size > 1 else None
            self.sync_tp_replicas = synchronize_tp_replica_gradients
            self.clip_grad_norm = partial(clip_grad_norm, moe_mesh=moe, ep_axis_name="ep" if moe else None)

    # -- forward ---------------------------------------------------------------------------------------
    def _micro_batches(self, shard: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Consecutive row slices of `shard` on the device, each trimmed to its longest row (right padding
        never influences earlier tokens): `train.micro_batch_size` rows each, or with
        `train.micro_batch_tokens` as many rows as fit that many real tokens (`_forward` packs them)."""
        train = self.spec.train
        rows = shard["input_ids"].shape[0]
        if train.micro_batch_tokens is None:
            size = train.micro_batch_size
            groups = [range(start, min(start + size, rows)) for start in range(0, rows, size)]
        else:
            groups = token_budget_groups(shard["attention_mask"].sum(-1).tolist(), train.micro_batch_tokens)
        out = []
        for g in groups:
            mb = {k: v[g.start:g.stop] for k, v in shard.items()}
            length = int(mb["attention_mask"].sum(-1).max())
            out.append({k: (v if k in IMAGE_KEYS else v[:, :length]).to(self.device) for k, v in mb.items()})
        if train.micro_batch_tokens is not None:
            # A budget splits the ranks' shards into different counts, but FSDP's gathers are collective:
            # every rank runs as many forwards as the busiest one, the extra ones on an inert row.
            count = torch.tensor([len(out)], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            out += [inert_rows({k: v[:1, :1] for k, v in out[0].items()}, 1)] * (int(count) - len(out))
        return out

    def _forward(self, mb: dict[str, torch.Tensor], entropy: bool = False):
        """[b, t] logprobs (policy/reference) or values (critic) of one micro-batch already on the device, 0
        at t = 0 and on padding: with `train.micro_batch_tokens` computed on its packed row, with
        `parallel.cp_size` on this rank's share of the positions, and returned in the padded layout."""
        packing = self.spec.train.micro_batch_tokens is not None
        row, real = pack(mb) if packing else (mb, None)
        replay = self.spec.model.router_replay and self.role == "policy"   # the policy engine's picks
        inputs, scoring = model_inputs(row, replay, self.image_token), next_token_fields(row)
        length = row["input_ids"].shape[1]
        cp = None if self.cp_group is None else Shard.of(self.cp_group, length, self.device)
        if cp is not None:
            inputs, scoring = split(inputs, cp), {k: cp.take(v) for k, v in scoring.items()}
        placeholder = "image_grid_thw" in row and "pixel_values" not in inputs and self.tower_collectives
        scores = self._row_forward(inputs, scoring, entropy, cp, placeholder)
        if cp is not None:
            scores = tuple(cp.gather(s) for s in scores)
        # the score computed at position t is that of token t + 1
        scores = tuple(None if s is None else to_tokens(s[:, :length - 1]) for s in scores)
        return tuple(unpack(s, real) if packing and s is not None else s for s in scores)

    def _row_forward(self, inputs: dict[str, torch.Tensor], scoring: dict[str, torch.Tensor], entropy: bool,
                     cp: Shard | None, placeholder: bool):
        """At each position of `inputs`, the score of the token it predicts (`next_token_fields`): its logprob
        and entropy, or the critic's value. `placeholder`: run the vision tower without images."""
        inputs = dict(inputs)
        # Set for this forward and kept until the next one: activation checkpointing recomputes the layers
        # in the backward, after this returns, and the recomputation must take the same experts.
        set_routes(self.model, inputs.pop("routed_experts", None))
        autocast = torch.autocast("cuda" if self.cuda else "cpu", self.autocast or torch.float32,
                                  enabled=self.autocast is not None)
        chunked = self.role != "critic" and chunkable(self.model, self.spec.parallel)
        head = self.model.get_output_embeddings() if chunked else None
        # a VLM batch's micro-batch without an image still runs a sharded tower's collectives, as its peers do
        with head_input(head) as hidden, autocast, tower_in_every_forward(self.model, placeholder):
            logits = self.model(**inputs, **({} if cp is None else {"cp_shard": cp}), use_cache=False).logits
        logits = logits.float()
        # the distribution each token was sampled from: recorded per token, else `self.scoring`
        sampling = tuple(scoring.get(k, default)
                         for k, default in zip(RECORDED_SAMPLING, self.scoring, strict=True))
        if hidden:   # only sampled tokens are scored (the loss and the mismatch need no other)
            with autocast:
                chunk = chunk_tokens(self.spec, head.weight.shape[0])
                return chunked_next_token_logprobs(hidden[0], head, scoring["targets"], scoring["select"],
                                                   *sampling, entropy, chunk,
                                                   shared_chunk_count(scoring["select"], chunk))
        if isinstance(logits, DTensor):  # tensor parallel: the output head is sharded over the vocabulary
            logits = logits.full_tensor()
        if self.role == "critic":
            # V(tokens < t+1), read before token t+1: the baseline of the action t+1 must not have seen it,
            # or every action's advantage would partly cancel itself
            return logits[..., 0] * scoring["scored"], None
        return next_token_logprobs(logits, scoring["targets"], scoring["scored"], *sampling, entropy)

    @torch.no_grad()
    def forward(self, shard: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(shard["input_ids"].shape, dtype=torch.float32)
        start = 0
        for mb in self._micro_batches(shard):
            self.threads.start_micro_batch()
            rows, length = mb["input_ids"].shape
            scores = self._forward(mb)[0].cpu()
            if start < out.shape[0]:  # the inert micro-batches that even out ranks come last
                out[start:start + rows, :length] = scores
            start += rows
        self._release_cached_memory()
        return out

    # -- training --------------------------------------------------------------------------------------
    def _all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        # the cp and tp ranks of one data shard hold the same rows (cp: gathered in `_forward`), so they
        # compute the same loss and metrics: count each replica once
        return (t / self.spec.parallel.replica_ranks).tolist()

    def update(self, shard: dict[str, torch.Tensor], algo: AlgoSpec | None = None,
               record: bool = False) -> dict[str, float]:
        """train.epochs passes over this rank's shard split into train.minibatches row chunks, one
        optimizer step per chunk; returns globally reduced metrics (same on all ranks) under the names the
        run logs (molt/trainer/step_metrics.py). `algo` is the step's (the loop's: the adaptive KL
        controller's weight in algo.kl.coef); None: the spec's. `record`: keep what the policy loss saw of
        each token (`token_record`).

        With more than one update the policy's old logprobs are computed once here, before the first
        update, unless the batch brings them; with one update they are the update's own forward."""
        spec, algo = self.spec, algo or self.spec.algo
        updates = spec.train.minibatches * spec.train.epochs
        if updates > 1 and self.role == "policy" and not self.sft and "old_logp" not in shard:
            shard = dict(shard, old_logp=self.forward(shard))
        rows = shard["input_ids"].shape[0]
        # equal row shards on every rank give equal chunks, so every rank steps (or skips) together
        bounds = [rows * i // spec.train.minibatches for i in range(spec.train.minibatches + 1)]
        self.model.train()
        self.record = TokenRecord(*shard["input_ids"].shape) if record and self.role == "policy" else None
        metrics = StepMetrics()
        for epoch in range(spec.train.epochs):
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                last = epoch == spec.train.epochs - 1 and hi == rows
                part = {k: v[lo:hi] for k, v in shard.items()}
                grad_norm = self._update(part, algo, metrics, epoch == 0, last and updates > 1)
                if grad_norm is not None:
                    metrics.grad_norms.append(grad_norm)
        if not metrics.grad_norms:  # the same on every rank: all of them raise
            raise ValueError("update got a batch without sampled tokens (loss_mask is all 0)")
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # counts the batches this role trains on, not updates (schedule.py)
        self.step += 1
        self._release_cached_memory()
        # One worker class serves both roles, so its role names the section; the loop logs these as they are.
        section = "critic/" if self.role == "critic" else "train/"
        return metrics.reduce(section, lr, updates > 1, self._all_sum, self.device)

    def _release_cached_memory(self) -> None:
        """parallel.colocate on cuda: the blocks this pass freed go back to the GPU, where the engine wakes
        into them; the caching allocator would keep them for this rank's next pass."""
        if self.cuda and self.spec.parallel.colocate:
            torch.cuda.empty_cache()

    def _update(self, part: dict[str, torch.Tensor], algo: AlgoSpec, step: StepMetrics, first_pass: bool,
                last: bool) -> float | None:
        """Forward/backward over the micro-batches of `part` and one optimizer step; adds to `step`.
        Returns the gradient norm, or None when no rank's `part` holds a sampled token (no step)."""
        mbs = self._micro_batches(part)
        budget = self.spec.response_budget   # seq-mean-token-sum-norm's fixed divisor
        normalizer = LOSS_NORMS["token"].normalizer if self.sft else lambda m, b: loss_normalizer(m, algo, b)
        norm = self._all_sum([sum(normalizer(mb["loss_mask"], budget) for mb in mbs)])[0]
        if norm == 0:
            return None
        record = self.record.part(part["input_ids"].shape[0]) if self.record and first_pass else None
        for mb in mbs:
            mask = mb["loss_mask"] > 0
            n_tok = int(mask.sum())
            self.threads.start_micro_batch()
            if self.role == "critic":
                values, _ = self._forward(mb)
                loss, metrics = value_loss(values, mb, algo, norm)
            elif self.sft:
                loss, metrics = sft_loss(self._forward(mb)[0], mb, norm)
            else:
                logp, ent = self._forward(mb, entropy=algo.loss.entropy_coef != 0 or record is not None)
                lb = dict(mb)
                lb.setdefault("old_logp", logp.detach())  # one update per batch: old == current
                if algo.loss.entropy_coef:
                    lb["entropy"] = ent
                if record:
                    record.add(mb, lb["old_logp"], ent, algo.correction)
                loss, metrics = policy_loss(logp, lb, algo, norm)
                # The gap to the engine, on the tokens sampled by the weights held before the update (all
                # of them unless the loop marks older-policy tokens out with `current_mask`).
                current = mask & (mb["current_mask"] > 0) if "current_mask" in mb else mask
                if first_pass and "behaviour_logp" in mb and current.any():
                    step.gap((lb["old_logp"] - mb["behaviour_logp"])[current])
            loss.backward()
            step.micro_batch(loss, n_tok, metrics, self.threads.mean(), first_pass, last)
        return self._step(self.spec.train.grad_clip)

    def _step(self, max_norm: float) -> float:
        """One optimizer step on the gradients accumulated so far, clipped to `max_norm` (inf: unclipped);
        returns their global norm before clipping."""
        # Parameters replicated over tensor-parallel ranks (norms) got each rank's part of the gradient:
        # reduce them once; then clip with AutoModel, which groups gradients by mesh (TP and FSDP
        # parameters live on different meshes, which torch's clip_grad_norm_ cannot mix).
        self.sync_tp_replicas([self.model], self.mesh)
        grad_norm = self.clip_grad_norm(max_norm, [self.model])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def token_record(self) -> dict[str, torch.Tensor]:
        """The last `update(record=True)`'s per-token record of this rank's shard ([rows, T] per field)."""
        record, self.record = self.record, None
        return record.tensors() if record else {}

    # -- client-driven steps (molt.tinker): gradients accumulate over calls until `apply_gradients` ----
    def accumulate(self, shard: dict[str, torch.Tensor], loss: str, config: dict[str, Any],
                   backward: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """The logprob of each row's `target_ids` [B, T] and the summed datum loss `loss` (with `config`:
        molt.algo.datum_losses) of this rank's rows; with `backward` its gradient is added to the
        parameters' gradients, which nothing else zeroes but `apply_gradients`. Returns the rows' logprobs
        and, reduced over the group: `loss`, and the trainer/engine gap on the tokens `current_mask` marks
        (those the engines sampled with the weights the trainer holds) as `mismatch/*` sums."""
        fn = datum_loss(loss, config)
        self.model.train(backward)
        out = torch.zeros(shard["input_ids"].shape, dtype=torch.float32)
        sums = StepMetrics()
        start = 0
        with torch.enable_grad() if backward else torch.no_grad():
            for mb in self._micro_batches(shard):
                self.threads.start_micro_batch()
                rows, length = mb["input_ids"].shape
                logp = self._forward(mb)[0]
                value, _ = fn(logp, mb)
                if backward:
                    value.backward()
                sums.add("loss", value.detach())
                current = mb["current_mask"] > 0
                if current.any():
                    sums.gap((logp.detach() - mb["behaviour_logp"])[current])
                if start < out.shape[0]:   # the inert micro-batches that even out ranks come last
                    out[start:start + rows, :length] = logp.detach().cpu()
                start += rows
        keys = ["loss", "mismatch/tokens", "mismatch/abs_sum", "mismatch/k3_sum"]
        return out, sums.totals(keys, self._all_sum, self.device)

    def apply_gradients(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                        max_norm: float) -> float:
        """One AdamW step with these hyperparameters (a client sends them with every step) on the
        gradients `accumulate` added up since the last step, clipped to `max_norm` (inf: unclipped);
        returns the gradient norm before clipping."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        norm = self._step(max_norm)
        self.step += 1
        return norm

    # -- weights and checkpoints -----------------------------------------------------------------------
    def host_refit(self, world_size: int) -> tuple[str, int]:
        """Rank 0: close the last refit group and listen for the next one's `world_size` ranks
        (`molt.refit.listen`); returns the address the engine workers join at."""
        refit.close_group(self.refit_group)
        self.refit_group = None
        self.refit_store = refit.listen(ray.util.get_node_ip_address(), world_size)
        return ray.util.get_node_ip_address(), self.refit_store.port

    def join_refit(self, world_size: int) -> None:
        """Rank 0: open the refit group `host_refit` listens for; returns once all `world_size` joined.
        A colocated engine shares this device: its payloads go by handle (`molt.refit`, shared)."""
        self.refit_group = refit.host_group(self.refit_store, world_size, self.device,
                                            shared=self.spec.parallel.colocate)

    @ray.method(concurrency_group="control")   # runs while `send_weights` waits in the default group
    def abort_refit(self) -> None:
        """Rank 0: abort the refit group, whose receivers died mid-transfer (`molt.refit.close_group`)."""
        if self.cuda:   # gloo's abort does not unblock a waiting broadcast (tried): leave it be there
            refit.close_group(self.refit_group)

    def send_weights(self) -> int:
        """Full weights (or the LoRA adapter) to the engines: all ranks gather, rank 0 sends; bytes sent."""
        chunk_bytes = int(self.spec.rollout.refit_chunk_mb * 2**20)
        chunks = weights.refit_chunks(self.model, self.spec, chunk_bytes, self.device, self.fp8)
        try:
            return refit.send(self.refit_group, chunks, self.device, chunk_bytes,
                              shared=self.spec.parallel.colocate) if self.rank == 0 else 0
        finally:   # the other ranks only take part in the gathers; so does rank 0 after a failed stream
            for _ in chunks:
                pass

    def export_hf(self, path: str) -> None:
        weights.export_hf(self.model, self.path, path, DTYPES[self.spec.model.dtype], self.device,
                          self.spec.model.trust_remote_code)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        rank_state.save(path, self.model, self.optimizer, self.scheduler,
                        {"step": self.step, "role": self.role, "extra": extra})

    def load(self, path: str, weights_only: bool = False) -> dict[str, Any]:
        """Restore a `save`d state; `weights_only` restores the model alone (export, a fresh optimizer).
        Gradients accumulated before (molt.tinker's `accumulate`) are dropped: a checkpoint holds none."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if weights_only:
            if self.optimizer is not None:
                self.optimizer.state.clear()   # no moments: the next step starts AdamW afresh
            return rank_state.load(path, self.model, None, None)["extra"]
        meta = rank_state.load(path, self.model, self.optimizer, self.scheduler)
        self.step = meta["step"]
        return meta["extra"]

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
