"""Drop the third-party import noise every Molt process would print, by exact message and nothing else.

Importing vLLM or NeMo AutoModel pulls in torchao, which logs "Failed to load ..." for each CUDA-only
kernel library it cannot load (on CPU, or another GPU generation), and registers Enums with torch's
pytree, which logs a deprecation for each; megatron_fsdp warns that Transformer Engine and Apex are
absent, and vLLM's kernel scan trips torch's `reduce_op` deprecation. None is actionable for a Molt
user, so these messages are dropped; every other warning of these libraries still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

LOG_NOISE = {   # logger -> messages it may drop
    "torchao": re.compile(r"^Failed to load .*torchao"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
}
WARNING_NOISE = (   # (message regex, category) for warnings.filterwarnings
    ("Transformer Engine and Apex are not installed", UserWarning),
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning),
)


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_import_noise() -> None:
    """Install the filters (idempotent); molt/__init__.py calls it, so every process importing Molt
    (the driver, and each Ray actor before it imports vLLM or AutoModel) has them."""
    for name, pattern in LOG_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))
    for message, category in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
