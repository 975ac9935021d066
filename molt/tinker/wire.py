"""The protobuf half of the wire: what the SDK sends as protobuf (forward/backward requests) read into plain
arrays, and the two results it reads as protobuf (forward/backward outputs, samples) written from arrays.
The messages are the pinned SDK's own (`tinker.proto.tinker_public_pb2`); the JSON half of the wire is
its pydantic types (molt/tinker/app.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from molt.tinker import Refused

DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclass
class Datum:
    tokens: np.ndarray                                          # model_input, int64 [T]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)   # loss_fn_inputs, dense


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _array(tensor: pb.Tensor, name: str) -> np.ndarray:
    if tensor.dtype not in DTYPES:
        raise Refused(f"loss_fn_inputs[{name!r}] has dtype {pb.DType.Name(tensor.dtype)}, not served "
                      "(float32, int64)")
    if tensor.HasField("sparse_csr"):   # the SDK sends only 2-D inputs sparse: one value per position here
        raise Refused(f"loss_fn_inputs[{name!r}] is a sparse 2-D tensor: not served (one value per position)")
    values = np.frombuffer(tensor.dense, dtype=DTYPES[tensor.dtype])
    return values.reshape(list(tensor.shape)) if len(tensor.shape) else values


def _tokens(chunks: list[pb.Chunk]) -> np.ndarray:
    parts = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise Refused(f"a model_input chunk of type {kind!r} is not served (images and audio are not: "
                          "token chunks only)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def read_forward_backward(body: bytes) -> ForwardBackward:
    """A `/forward_backward` request body (the SDK's `forward_backward_request_to_proto`)."""
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():   # newer SDKs write both; v2 also carries strings
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for datum in msg.data:
        if len(datum.model_input_spans) or len(datum.loss_fn_input_spans):
            raise Refused("datum provenance spans (model_input_spans / loss_fn_input_spans, for "
                          "stable_reinforce) are not served")
        data.append(Datum(_tokens(datum.model_input),
                          {name: _array(t, name) for name, t in datum.loss_fn_inputs.items()}))
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    sizes = [a.nbytes for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                            dtype=dtype)


def write_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: each datum's target logprobs (`logprobs` [T]) and the request's metrics
    (named `name:reduction`, the SDK's rule for combining the chunks of one call)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs),
                            fields={"logprobs": _batched([a.astype(np.float32) for a in logprobs],
                                                         pb.DTYPE_FLOAT32)})
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=metrics).SerializeToString()


def write_sample_response(sequences: list[tuple[str, list[int], list[float]]],
                          prompt_logprobs: list[float | None] | None) -> bytes:
    """A SampleResponse: (stop reason, tokens, logprobs) per sequence; prompt logprobs with NaN where
    there is none (the first token, or before `prompt_logprobs_last_n`)."""
    msg = pb.SampleResponse(sequences=[
        pb.SampledSequence(stop_reason=STOP_REASONS[reason], tokens=np.asarray(tokens, np.int32).tobytes(),
                           logprobs=np.asarray(logprobs, np.float32).tobytes())
        for reason, tokens, logprobs in sequences])
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([np.nan if lp is None else lp for lp in prompt_logprobs],
                                         np.float32).tobytes()
    return msg.SerializeToString()
