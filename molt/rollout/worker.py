"""Code that runs inside vLLM's worker process (installed with `worker_extension_cls`).

On CPU vLLM repacks linear weights for oneDNN, so a direct `model.load_weights` corrupts the model;
the worker's own `reload_weights` re-runs that processing. Tensors cannot cross the engine's process
boundary through `collective_rpc`, so new weights arrive as safetensors files (in shared memory).
The MoE route capture hooks (`molt_capture_*`) come from `RouterCapture`, next to the replay they feed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from molt.rollout.engine_args import on_cpu
from molt.trainer.router_replay import RouterCapture


def _read(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class MoltWorkerExtension(RouterCapture):
    """Methods vLLM mixes into its worker class; reached with `collective_rpc(name, ...)`."""

    def molt_reload_files(self, paths: list[str]) -> None:
        self.reload_weights(weights_iterator=_read(paths), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        if self.model_config.hf_config.get_text_config().tie_word_embeddings:
            # A tied lm_head receives no checkpoint tensor, so the reload puts its *old* processed
            # weight back (vLLM 0.32, "ParallelLMHead: Failed to load weights"); tie and process again.
            head = model.lm_head
            head.weight = model.model.embed_tokens.weight
            head.quant_method.process_weights_after_loading(head)
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and on_cpu():
                # vLLM 0.32 skips the CPU MoE kernel's prepack on a weight *update* and copies the
                # checkpoint-layout experts into the prepacked storage; redo the prepack in place.
                kernel.fused_experts.process_weights_after_loading(module)
