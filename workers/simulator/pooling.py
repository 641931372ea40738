"""vLLM's pooling runner (`--runner pooling --convert embed`): `/v1/embeddings`.

Each input is one prefill-only sequence in the scheduler: it queues, takes KV blocks, hits
the prefix cache and counts in the metrics like a request that finishes ("stop") as soon as
its prompt is computed. The vector is a pseudo-embedding: a unit vector drawn from a seed
that is a stable hash of the token ids (and adapter), so equal inputs embed equally in every
process. Its size is the model's, read from config.json (`embedding_size`, else
`hidden_size`) as vLLM does, else DEFAULT_DIM.

Shapes, codes and messages are vLLM 0.32's, as captured in tests/data/vllm_pooling/.
"""

from __future__ import annotations

import base64
import json
import math
import random
import struct
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetgate.hashing import stable_hash
from workers.simulator.flavors import SimError
from workers.simulator.kvcache import block_hashes
from workers.simulator.requests import Context, bad, invalid, resolve_model
from workers.simulator.seqs import Seq
from workers.simulator.tokens import TextSource, render_prompt

DEFAULT_DIM = 128
Json = dict[str, Any]
# embed_dtype -> (struct format, bytes kept of a little-endian float32); bfloat16 is the
# upper half of a float32.
_DTYPES = {"float32": ("f", 4), "float16": ("e", 2), "bfloat16": ("f", 2)}
_ALL_DTYPES = (*_DTYPES, "fp8_e4m3", "fp8_e5m2")  # vLLM's; the fp8 ones are not simulated
_FORMATS = ("float", "base64", "bytes", "bytes_only")


@dataclass(frozen=True, kw_only=True)
class EmbedModel:
    """What the model's config says about its embeddings."""

    dim: int = DEFAULT_DIM
    matryoshka: bool = False
    matryoshka_dims: tuple[int, ...] | None = None

    @classmethod
    def from_folder(cls, model: str) -> EmbedModel:
        path = Path(model) / "config.json"
        if not path.is_file():
            return cls()
        config = json.loads(path.read_text())
        dims = config.get("matryoshka_dimensions")
        return cls(
            dim=int(config.get("embedding_size") or config.get("hidden_size") or DEFAULT_DIM),
            matryoshka=bool(dims) or bool(config.get("is_matryoshka")),
            matryoshka_dims=tuple(dims) if dims else None,
        )


@dataclass(frozen=True, kw_only=True)
class EmbedRequest:
    model: str
    adapter: str | None
    prompts: list[list[int]]
    dimensions: int
    encoding_format: str
    embed_dtype: str
    endianness: str


def vector(ids: Sequence[int], dim: int, namespace: str = "") -> list[float]:
    """The unit pseudo-embedding of a prompt (float32 values)."""
    rng = random.Random(stable_hash("embed", namespace, ",".join(map(str, ids))))
    raw = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def truncated(values: list[float], dimensions: int) -> list[float]:
    """Matryoshka: the leading `dimensions` values, normalised again; float32-rounded."""
    head = values[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    head = [x / norm for x in head]
    return list(struct.unpack(f"<{len(head)}f", struct.pack(f"<{len(head)}f", *head)))


def encode_base64(values: list[float], dtype: str, endianness: str) -> str:
    fmt, width = _DTYPES[dtype]
    raw = struct.pack(f"<{len(values)}{fmt}", *values)
    if dtype == "bfloat16":
        raw = b"".join(raw[i + 2 : i + 4] for i in range(0, len(raw), 4))
    if endianness == "big":
        raw = b"".join(raw[i : i + width][::-1] for i in range(0, len(raw), width))
    return base64.b64encode(raw).decode()


def _choice(body: Mapping[str, Any], key: str, default: str, allowed: Sequence[str]) -> str:
    value = body.get(key, default)
    if value not in allowed:
        quoted = [f"'{a}'" for a in allowed]
        expected = f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        msg = f"Input should be {expected}"
        raise invalid(("literal_error", f"body.{key}", msg, str(value)), ctx={"expected": expected})
    return str(value)


def _prompts(body: Mapping[str, Any], ctx: Context) -> list[tuple[list[int], bool]]:
    """Each input's token ids, and whether it came as text (vLLM then cuts at limit + 1)."""
    messages = body.get("messages")
    value = body.get("input")
    if messages is None and isinstance(value, list) and value and isinstance(value[0], dict):
        messages = value
    if messages is not None:
        return [(_chat_prompt(body, messages, ctx), True)]
    if "input" not in body:
        raise invalid(("missing", "body.input", "Field required", f"<dict of {len(body)} items>"))
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and not value:
        raise bad("You must pass at least one prompt", None)
    if isinstance(value, list) and (prompts := _input_prompts(value, ctx)) is not None:
        return prompts
    raise invalid(("list_type", "body.input", "Input should be a valid list", str(value)[:40]))


def _chat_prompt(body: Mapping[str, Any], messages: Any, ctx: Context) -> list[int]:
    """A chat's messages rendered by the model's template, as token ids."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise invalid(("list_type", "body.messages", "Input should be a valid list", "..."))
    add_prompt = bool(body.get("add_generation_prompt", False))
    text = render_prompt(
        ctx.tokens, messages, add_generation_prompt=add_prompt, continue_final=False,
    )  # fmt: skip
    return ctx.tokens.encode(text)


def _input_prompts(value: list[Any], ctx: Context) -> list[tuple[list[int], bool]] | None:
    """`input` as one token list, texts, or token lists; None for any other list."""
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [(list(value), False)]
    if all(isinstance(t, str) for t in value):
        return [(ctx.tokens.encode(t), True) for t in value]
    if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in value):
        return [(list(p), False) for p in value]
    return None


def _fit(ids: list[int], as_text: bool, keep: int | None, ctx: Context) -> list[int]:
    """vLLM's checks of one prompt: truncation (the first N tokens), vocabulary, length."""
    limit = ctx.max_model_len
    if keep is not None:
        ids = ids[: limit if keep == -1 else keep]
    if not ids:
        raise bad("The decoder prompt cannot be empty", None)
    if not as_text:
        unknown = next((t for t in ids if not ctx.tokens.known(t)), None)
        if unknown is not None:
            raise bad(f"Token id {unknown} is out of vocabulary", None)
    n = len(ids)
    if n > limit:
        # vLLM's tokenizer stops a text at limit + 1 tokens: it never knows more.
        n = min(n, limit + 1) if as_text else n
        at_least = "at least " if n == limit + 1 else ""
        raise bad(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {at_least}{n} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={n})",
            "input_tokens",
        )
    if n > ctx.kv_tokens:
        raise bad(f"the prompt ({n} tokens) does not fit the KV cache ({ctx.kv_tokens})")
    return ids


def _dimensions(body: Mapping[str, Any], name: str, info: EmbedModel) -> int:
    dimensions = body.get("dimensions")
    if dimensions is None:
        return info.dim
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise invalid(
            ("int_type", "body.dimensions", "Input should be a valid integer", str(dimensions))
        )
    if not info.matryoshka:
        raise bad(
            f"Model {name!r} does not support Matryoshka embeddings; dimensions must be unset "
            f"(received dimensions={dimensions}).",
            None,
        )
    if not 1 <= dimensions <= info.dim:
        message = (
            f"Model {name!r} only supports dimensions in range [1, {info.dim}], got {dimensions}."
        )
        raise bad(message, None)
    if info.matryoshka_dims and dimensions not in info.matryoshka_dims:
        message = (
            f"Model {name!r} only supports Matryoshka dimensions "
            f"{list(info.matryoshka_dims)}, got {dimensions}."
        )
        raise bad(message, None)
    return dimensions


def parse_embedding(body: Any, ctx: Context, info: EmbedModel) -> EmbedRequest:
    if not isinstance(body, dict):
        raise invalid(("model_attributes_type", "body", "Input should be a valid dictionary", ""))
    try:
        model, adapter = resolve_model(body, ctx)
    except SimError as err:  # here vLLM names no param
        raise SimError(err.status, err.kind, err.message, None) from err
    encoding_format = _choice(body, "encoding_format", "float", _FORMATS)
    embed_dtype = _choice(body, "embed_dtype", "float32", _ALL_DTYPES)
    if embed_dtype not in _DTYPES:
        raise bad(f"the simulator does not encode embed_dtype {embed_dtype}", "embed_dtype")
    endianness = _choice(body, "endianness", "native", ("native", "big", "little"))
    dimensions = _dimensions(body, ctx.served_name, info)
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
            raise invalid(("greater_than_equal", "body.truncate_prompt_tokens",
                           "Input should be greater than or equal to -1", str(keep)))  # fmt: skip
        if keep > ctx.max_model_len:
            raise bad(
                "truncate_prompt_tokens value is greater than max_model_len. "
                "Please request a smaller truncation size.",
                None,
            )
    prompts = [_fit(ids, as_text, keep, ctx) for ids, as_text in _prompts(body, ctx)]
    return EmbedRequest(
        model=model, adapter=adapter, prompts=prompts, dimensions=dimensions,
        encoding_format=encoding_format, embed_dtype=embed_dtype, endianness=endianness,
    )  # fmt: skip


class Embeddings:
    """One engine's embeddings endpoint on its scheduler."""

    def __init__(self, model: str, block_size: int) -> None:
        self.model = EmbedModel.from_folder(model)
        self.block_size = block_size
        self._count = 0

    def seqs(self, req: EmbedRequest) -> list[Seq]:
        namespace = req.adapter or ""
        out = []
        for ids in req.prompts:
            self._count += 1
            out.append(
                Seq(
                    id=f"pool-{self._count}",
                    prompt_ids=ids,
                    hashes=block_hashes(ids, self.block_size, namespace),
                    source=TextSource(0),
                    target=0,
                    target_reason="stop",
                    adapter=req.adapter,
                    pooling=True,
                )
            )
        return out

    async def run(
        self, req: EmbedRequest, submit: Callable[[Seq], None], abort: Callable[[Seq], None]
    ) -> list[list[float]]:
        """Submit every input, wait until all are pooled; their vectors."""
        seqs = self.seqs(req)
        for seq in seqs:
            submit(seq)
        try:
            for seq in seqs:
                await seq.events.get()  # the only event: finished
        finally:
            for seq in seqs:
                if seq.status in ("waiting", "running"):  # the client went away
                    abort(seq)
        namespace = req.adapter or ""
        return [
            truncated(vector(ids, self.model.dim, namespace), req.dimensions) for ids in req.prompts
        ]


def response_json(req: EmbedRequest, vectors: list[list[float]], request_id: str) -> Json:
    """vLLM's EmbeddingResponse, keys in its order."""
    data = []
    for index, values in enumerate(vectors):
        embedding: list[float] | str = values
        if req.encoding_format == "base64":
            embedding = encode_base64(values, req.embed_dtype, req.endianness)
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    n = sum(len(ids) for ids in req.prompts)
    return {
        "id": f"embd-{request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model,
        "data": data,
        "usage": {
            "prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
            "prompt_tokens_details": None, "completion_tokens_details": None,
        },
    }  # fmt: skip


def response_bytes(
    req: EmbedRequest, vectors: list[list[float]], request_id: str
) -> tuple[dict[str, str], bytes]:
    """encoding_format bytes: the raw vectors, described in a `metadata` header (none for
    bytes_only)."""
    chunks = [base64.b64decode(encode_base64(v, req.embed_dtype, req.endianness)) for v in vectors]
    if req.encoding_format == "bytes_only":
        return {}, b"".join(chunks)
    items, start = [], 0
    for index, (chunk, values) in enumerate(zip(chunks, vectors, strict=True)):
        items.append({"index": index, "embed_dtype": req.embed_dtype, "endianness": req.endianness,
                      "start": start, "end": start + len(chunk), "shape": [len(values)]})  # fmt: skip
        start += len(chunk)
    n = sum(len(ids) for ids in req.prompts)
    metadata = {"id": f"embd-{request_id}", "created": int(time.time()), "model": req.model,
                "data": items, "usage": {"prompt_tokens": n, "total_tokens": n}}  # fmt: skip
    return {"metadata": json.dumps(metadata)}, b"".join(chunks)


def request_id(header: str | None, body: Mapping[str, Any]) -> str:
    """vLLM's: the X-Request-Id header, else the body's request_id, else a short uuid."""
    from_body = body.get("request_id")
    return header or (from_body if isinstance(from_body, str) else uuid.uuid4().hex[:16])
