"""`parallel.offload=optimizer`: AdamW whose state lives in host memory while parameters and gradients
stay on the device.

Each parameter's state visits the parameter's device only for that parameter's own update and goes back
to the host right after, so the device holds one parameter's optimizer state at a time instead of all of
it (for AdamW, two fp32 tensors the size of the parameters). The update itself is torch's AdamW. On CPU
the moves are no-ops and the same code runs. `offload=full` is FSDP2's CPUOffloadPolicy instead
(parameters, gradients and state on the host; molt/trainer/model.py).
"""

from __future__ import annotations

from typing import Any

import torch

HOST = torch.device("cpu")


class HostStateAdamW(torch.optim.AdamW):
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("HostStateAdamW.step takes no closure")
        groups = self.param_groups
        try:
            for group in groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    self._move_state(param, param.device)
                    self.param_groups = [{**group, "params": [param]}]  # AdamW then updates only `param`
                    super().step()
                    self._move_state(param, HOST)
        finally:
            self.param_groups = groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # puts every state tensor on its parameter's device
        for group in self.param_groups:
            for param in group["params"]:
                self._move_state(param, HOST)

    def _move_state(self, param: torch.Tensor, device: torch.device) -> None:
        state = self.state[param]
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # AdamW keeps `step` on the host already
                state[key] = value.to(device)
