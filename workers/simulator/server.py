"""The simulator's HTTP face: vLLM's (or LMDeploy's) OpenAI server on top of the scheduler.

`create_app(config)` builds everything a process needs; nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from workers.simulator.config import SimConfig
from workers.simulator.engine import Simulator
from workers.simulator.flavors import SimError
from workers.simulator.pooling import (
    parse_embedding,
    request_id,
    response_bytes,
    response_json,
)
from workers.simulator.requests import Kind, prepare
from workers.simulator.streams import respond_json, respond_stream
from workers.simulator.tokenizing import detokenize, tokenize

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


SIM = web.AppKey("simulator", Simulator)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


async def _body(request: web.Request) -> Any:
    try:
        return msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise SimError(400, "bad_request", f"malformed JSON body: {exc}") from exc


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SimError as err:
        return _json(request.app[SIM].flavor.error_json(err), err.status)
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, 405)


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    sim = request.app[SIM]
    body = await _body(request)
    sim.admit_or_fail()
    prep = prepare(body, kind, sim.context)
    seqs = sim.new_seqs(prep)
    sim.scheduler.submit_all(seqs)
    try:
        if prep.stream:
            return await respond_stream(
                request, sim.flavor, prep, seqs, sim.faults, sim.scheduler.abort
            )
        return await respond_json(sim.flavor, prep, seqs)
    finally:
        for seq in seqs:
            if seq.status in ("waiting", "running"):  # client gone, or a stall: free the engine
                sim.scheduler.abort(seq)


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def create_response(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM]
    body = await _body(request)
    sim.admit_or_fail()
    turn = sim.responses.parse(body, sim.context)
    seq = sim.new_seq(turn.prep)
    sim.scheduler.submit(seq)
    if turn.background:  # runs on; a cancel aborts it
        return _json(sim.responses.start_background(turn, seq))
    try:
        if turn.prep.stream:
            return await sim.responses.stream(request, turn, seq, sim.faults, sim.scheduler.abort)
        return _json(await sim.responses.complete(turn, seq))
    finally:
        if seq.status in ("waiting", "running"):
            sim.scheduler.abort(seq)


async def embeddings(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    body = await _body(request)
    sim.admit_or_fail()
    req = parse_embedding(body, sim.context, sim.embeddings.model)
    rid = request_id(request.headers.get("X-Request-Id"), body)
    vectors = await sim.embeddings.run(req, sim.scheduler.submit, sim.scheduler.abort)
    if req.encoding_format in ("bytes", "bytes_only"):
        headers, raw = response_bytes(req, vectors, rid)
        return web.Response(body=raw, headers=headers, content_type="application/octet-stream")
    return _json(response_json(req, vectors, rid))


async def tokenize_prompt(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    return _json(tokenize(await _body(request), sim.context))


async def detokenize_ids(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    return _json(detokenize(await _body(request), sim.context))


async def get_response(request: web.Request) -> web.StreamResponse:
    response = request.app[SIM].responses.retrieve(request.match_info["response_id"])
    if request.query.get("stream", "").lower() in ("1", "true"):
        # vLLM replays only background streams; for any other stored id the stream is empty.
        return web.Response(content_type="text/event-stream", charset="utf-8")
    return _json(response)


async def cancel_response(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    return _json(sim.responses.cancel(request.match_info["response_id"], sim.scheduler.abort))


async def health(request: web.Request) -> web.Response:
    body = request.app[SIM].flavor.health_body
    return web.Response(body=body, content_type="application/json" if body else None)


async def models(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    base = sim.config.served_model_name
    cards = [sim.model_card(base, sim.config.model_path, None)]
    cards += [sim.model_card(name, path, base) for name, path in sim.adapters.items()]
    return _json({"object": "list", "data": cards})


async def metrics(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    text = sim.metrics.render(sim.scheduler.published)
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def load_lora(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    body = await _body(request)
    name, path = (
        (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    )
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise SimError(400, "invalid_input", "Both 'lora_name' and 'lora_path' must be provided.")
    if name in sim.adapters and not body.get("load_inplace"):
        raise SimError(
            400,
            "invalid_input",
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True.",
        )
    if not await asyncio.to_thread(os.path.exists, path):
        raise SimError(404, "not_found", f"Loading lora {name} failed: No adapter found for {path}")
    sim.adapters[name] = path
    sim.scheduler.adapter_loaded(name)  # into host memory; a reload in place takes a fresh slot
    sim.metrics.on_lora_api_load()
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    body = await _body(request)
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise SimError(
            400, "invalid_input", "'lora_name' needs to be provided to unload a LoRA adapter."
        )
    if name not in sim.adapters:
        raise SimError(404, "not_found", f"The lora adapter '{name}' cannot be found.")
    del sim.adapters[name]
    sim.scheduler.forget_adapter(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def set_faults(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    body = await _body(request)
    if not isinstance(body, dict):
        raise SimError(400, "bad_request", "faults must be a JSON object")
    try:
        sim.faults.update(body)
    except ValueError as exc:
        raise SimError(400, "bad_request", str(exc)) from exc
    if "die_at" in body:
        sim.arm_die_timer()
    if sim.faults.kv_events_down:
        await sim.stop_kv_events()
    sim.scheduler.slowdown = sim.faults.slow
    return _json(sim.faults.as_dict())


async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[SIM].faults.as_dict())


async def reset(request: web.Request) -> web.Response:
    """Back to a cold engine between benchmark runs: empty prefix cache, empty LoRA slots,
    the adapters given at start (runtime loads undone). Counters keep counting (Prometheus
    counters never go back); a benchmark reads deltas. 409 while requests are in flight."""
    sim = request.app[SIM]
    try:
        sim.scheduler.reset()
    except RuntimeError as exc:
        raise SimError(409, "bad_request", f"cannot reset: {exc}") from exc
    sim.adapters.clear()
    sim.adapters.update(sim.config.lora_modules)
    return _json({"ok": True, "adapters": sorted(sim.adapters)})


# Timing fields /sim/profile may change at run time; capacities are fixed at start.
TIMING_FIELDS = (
    "base_step_s", "decode_per_seq_s", "prefill_per_token_s", "lora_load_s",
    "lora_step_factor", "lora_step_s", "frontend_per_request_s", "frontend_per_token_s",
)  # fmt: skip


async def get_profile(request: web.Request) -> web.Response:
    return _json(dataclasses.asdict(request.app[SIM].scheduler.profile))


async def set_profile(request: web.Request) -> web.Response:
    """Replace timing fields of the running profile (the calibration script refits between
    measurements): {"base_step_s": 0.003, ...}; the next step uses them."""
    sim = request.app[SIM]
    body = await _body(request)
    if not isinstance(body, dict) or not body:
        raise SimError(400, "bad_request", "a JSON object of profile fields is expected")
    unknown = sorted(set(body) - set(TIMING_FIELDS))
    if unknown:
        raise SimError(
            400, "bad_request", f"unknown or fixed profile field(s) {unknown}; timing fields: "
            f"{', '.join(TIMING_FIELDS)}",
        )  # fmt: skip
    values: dict[str, Any] = {}
    for key, raw in body.items():
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < 0:
            raise SimError(400, "bad_request", f"{key} must be a number >= 0")
        values[key] = float(raw)
    sim.scheduler.profile = dataclasses.replace(sim.scheduler.profile, **values)
    return _json(dataclasses.asdict(sim.scheduler.profile))


async def state(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    snap = sim.scheduler.snapshot()
    snap.update(
        flavor=sim.flavor.name,
        profile=sim.config.profile,
        adapters=dict(sim.adapters),
        accepted=sim.accepted,
        faults=sim.faults.as_dict(),
    )
    return _json(snap)


def create_app(config: SimConfig) -> web.Application:
    sim = Simulator(config)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024**2)
    app[SIM] = sim
    app.cleanup_ctx.append(sim.lifespan)
    app.on_shutdown.append(sim.stop)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    # Like vLLM, a pooling model has no generation routes and a generative model no
    # embeddings route: either answers a plain 404.
    if config.pooling:
        app.router.add_post("/v1/embeddings", embeddings)
    else:
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/completions", completions)
    if sim.flavor.responses_api and not config.pooling:  # LMDeploy: a plain 404
        app.router.add_post("/v1/responses", create_response)
        app.router.add_get("/v1/responses/{response_id}", get_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    if sim.flavor.tokenizer_api:
        app.router.add_post("/tokenize", tokenize_prompt)
        app.router.add_post("/detokenize", detokenize_ids)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/state", state)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_post("/sim/reset", reset)
    app.router.add_get("/sim/profile", get_profile)
    app.router.add_post("/sim/profile", set_profile)
    if sim.flavor.runtime_lora and config.enable_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    return app
