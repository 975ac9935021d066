"""Third-party import noise is dropped by exact message; every other warning still shows.

The messages below are the libraries' own formats (torchao/__init__.py, torch/utils/_pytree.py,
megatron_fsdp/mixed_precision.py, vLLM's kernel scan touching torch.distributed.reduce_op)."""

from __future__ import annotations

import logging
import warnings

from molt.quiet import silence_import_noise


def test_known_import_noise_is_dropped(caplog):
    silence_import_noise()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning(
            "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not "
            "load this library: /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
            "Calling register_constant() on Enum subclasses is deprecated", "<enum 'KernelPreference'>")
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch")
        logging.getLogger("torch.utils._pytree").warning("a real pytree warning")
    assert [r.getMessage() for r in caplog.records] == \
        ["Skipping import of cpp extensions due to incompatible torch", "a real pytree warning"]


def test_known_warnings_are_dropped_and_others_are_not():
    emitted = [("Transformer Engine and Apex are not installed. Falling back to local implementations of "
                "multi_tensor_applier and multi_tensor_scale", UserWarning),
               ("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` "
                "instead",
                FutureWarning),
               ("a real user warning", UserWarning),
               ("`torch.distributed.reduce_op` is deprecated", UserWarning)]   # same text, another category
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_import_noise()
        for message, category in emitted:
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in seen] == [m for m, _ in emitted[2:]]
