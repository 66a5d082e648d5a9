"""The wire format between the API process and the worker processes: msgspec structs,
msgpack-encoded, one union per direction. One home for every field that crosses.

API -> rank 0 worker (`ToWorker`): requests to generate, an abort, or a named control
call (flush, stats, invariants, shutdown) answered by a `Reply` with the same `call_id`.
Rank 0 -> API (`FromWorker`): `Ready` once the model is loaded, `Outputs` once per
scheduler iteration (every request that produced something in it), `Reply`, and
`Crashed` with the reason when the worker's loop dies (then the process exits non-zero).

An output carries only the token ids the API process has not seen: `ids[k]` is output
token `ids_from + k`. `ids_from` can step back (jump-forward retokenizes the last sampled
token together with the forced text). The API process detokenizes; `text` is set only
when the worker had to decide it (a stop string matched: the text up to it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from sgl.runtime.disaggregation.protocol import Bootstrap
from sgl.runtime.sampling_params import SamplingParams


class Request(msgspec.Struct):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    bootstrap: Bootstrap | None = None  # PD: the sample's bootstrap room (disaggregation/rooms.py)


class Generate(msgspec.Struct, tag="gen"):
    """The requests of one generate call (a batch, n > 1): they reach the scheduler
    together, as one inbox message, so they are admitted together and share a prefix."""

    reqs: list[Request]


class Abort(msgspec.Struct, tag="abort"):
    rid: str


class Call(msgspec.Struct, tag="call"):
    """A control call; `name` is one of worker/serve.py's CALLS."""

    call_id: int
    name: str
    args: list[Any] = []


class Output(msgspec.Struct, tag="out"):
    rid: str
    ids_from: int
    ids: list[int]
    finished: bool
    meta_info: dict[str, Any]
    text: str | None = None


class Outputs(msgspec.Struct, tag="outs"):
    items: list[Output]


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    value: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag="ready"):
    """What the API process learns from rank 0 once every rank has loaded its shard."""

    max_total_tokens: int
    dtype: str
    device: str
    tp_size: int
    nnodes: int
    kv_pool_tokens_per_rank: list[int]
    kv_pool_bytes_per_rank: list[int]
    weight_bytes_per_rank: list[int]
    pids: list[int]


class Crashed(msgspec.Struct, tag="crashed"):
    reason: str


ToWorker = Generate | Abort | Call
FromWorker = Ready | Outputs | Reply | Crashed

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    return _from_worker.decode(data)


class Forward(msgspec.Struct, tag="fwd"):
    """Rank 0 -> every other tensor-parallel rank, once per step: what to run (the
    ForwardBatch as plain lists), the request -> token table writes since the last
    step, which only rank 0's scheduler makes, and the KV copies between the device pool
    and the host tier, which each rank runs on its own heads before the forward. `stop` ends the rank's loop; a Forward
    with no tokens is a keepalive (collectives time out after dist_timeout)."""

    input_ids: list[int] = []
    out_cache_loc: list[int] = []
    req_pool_indices: list[int] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    logits_indices: list[int] = []
    table_writes: list[tuple[int, int, list[int]]] = []
    kv_stores: list[tuple[int, list[int]]] = []  # hierarchical cache copies (StepPlan's)
    kv_loads: list[tuple[int, int, list[int]]] = []
    stop: bool = False


_forward = msgspec.msgpack.Decoder(Forward)


def decode_forward(data: bytes) -> Forward:
    return _forward.decode(data)


class WorkerSpec(msgspec.Struct):
    """How the API process (or a node's launcher) starts one rank: given as JSON on the
    worker's command line (python -m sgl.runtime.worker.process SPEC)."""

    config: dict[str, Any]  # EngineConfig fields
    hf_dir: str  # the model as a Hugging Face folder (a GGUF was converted by the launcher)
    rank: int
    dist_init_method: str  # tcp://HOST:PORT, or env:// under torchrun
    in_addr: str = ""  # rank 0 only: ZMQ address it pulls ToWorker messages from
    out_addr: str = ""  # rank 0 only: ZMQ address it pushes FromWorker messages to
    parent_pid: int = 0  # the worker exits when its parent is gone
    log_level: str = "WARNING"


def encode_spec(spec: WorkerSpec) -> str:
    return msgspec.json.encode(spec).decode()


def decode_spec(text: str) -> WorkerSpec:
    return msgspec.json.decode(text, type=WorkerSpec)
