"""`python -m workers`: start one engine on one GPU (or attach to one) and keep it registered.

    python -m workers --engine auto --gpu 0 --model /models/qwen7b --redis-url redis://host:6379/0
    python -m workers --engine sim --sim-profile h100-7b --model demo
    python -m workers --engine external --url http://10.0.0.5:8000 --flavor vllm
    python -m workers ... --dry-run      # print the engine command and why, start nothing
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

import yaml

from fleetgate.logs import configure_logging
from fleetgate.redis_server import free_port
from fleetgate.schema import GpuInfo
from workers.agent import AgentOptions, default_worker_id, run_agent
from workers.engines import EngineSpec, get_engine
from workers.gpu import DEFAULT_PROFILES, CardProfile, load_profiles, profile_for, query_gpus


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="auto", help="auto|sim|vllm|lmdeploy|external (default auto)")
    p.add_argument("--gpu", default="", help="GPU index, or a comma list for tensor parallel")
    p.add_argument("--model", default="", help="model path or name (default: the demo model for sim)")
    p.add_argument("--served-model-name", default="", help="name clients use (default: --model's)")
    p.add_argument("--adapters", default="", help="name=path,name=path LoRA adapters to load at start")
    p.add_argument("--port", type=int, default=0, help="engine port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address the engine listens on")
    p.add_argument("--advertise-host", default="",
                   help="host the gateway reaches the engine at (default: --host)")
    p.add_argument("--url", default="", help="--engine external: the running engine's base URL")
    p.add_argument("--flavor", default="vllm", help="--engine external: its API flavour (vllm|lmdeploy|sim)")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--sim-profile", default="", help="simulated card, e.g. h100-7b, t4-7b")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option (YAML value), overrides the card profile; repeatable")
    p.add_argument("--profiles", default=str(DEFAULT_PROFILES), help="card profile file")
    p.add_argument("--id", default="", help="worker id (default: host-gpuN-engine-port)")
    p.add_argument("--redis-url", default=os.environ.get("FLEETGATE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--redis-prefix", default=os.environ.get("FLEETGATE_REDIS_PREFIX", "fleetgate"))
    p.add_argument("--heartbeat-ttl", type=float, default=3.0)
    p.add_argument("--drain-grace", type=float, default=60.0, help="seconds to wait for in-flight work")
    p.add_argument("--health-timeout", type=float, default=900.0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--engine-log", default="", help="file for the engine's output")
    p.add_argument("--log-level", default=os.environ.get("FLEETGATE_LOG_LEVEL", "info"))
    p.add_argument("--dry-run", action="store_true", help="print the engine command and exit")
    return p


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option needs KEY=VALUE, got {pair!r}")
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def _adapters(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--adapters needs name=path, got {item!r}")
        out[name] = os.path.abspath(path) if os.path.exists(path) else path
    return out


def plan(args: argparse.Namespace) -> tuple[AgentOptions, list[str]]:
    """Decide engine, card profile and spec; return the options and the reasons."""
    why: list[str] = []
    gpu_ids = tuple(g for g in args.gpu.split(",") if g)
    gpus = {g.index: g for g in query_gpus()} if args.engine in ("auto", "vllm", "lmdeploy") else {}
    gpu: GpuInfo | None = gpus.get(gpu_ids[0]) if gpu_ids else None
    profiles = load_profiles(args.profiles)
    card: CardProfile | None = profile_for(gpu, profiles) if gpu else None
    engine_name = args.engine
    if engine_name == "auto":
        if card is None:
            engine_name = "sim"
            why.append(f"no GPU {args.gpu or '(none given)'} found by nvidia-smi: using the simulator")
        else:
            engine_name = card.engine
            why.append(f"{gpu.name if gpu else '?'}: profile {card.name} -> {engine_name} ({card.why})")
    options: dict[str, Any] = dict(card.options) if card and card.engine == engine_name else {}
    if engine_name == "sim":
        sim_profile = args.sim_profile or (card.sim_profile if card else "l40s-7b")
        options = {"profile": sim_profile}
        gpu = gpu or GpuInfo(name=f"simulated {sim_profile}", profile=sim_profile, index=args.gpu)
        why.append(f"simulated card profile {sim_profile}")
    options.update(_options(args.option))
    model = args.model or ("fleetgate-demo-7b" if engine_name in ("sim", "external") else "")
    if not model and engine_name != "external":
        raise SystemExit(f"--model is required for --engine {engine_name}")
    served = args.served_model_name or (os.path.basename(model.rstrip("/")) if model else "")
    max_len = args.max_model_len or (card.max_model_len if card and card.max_model_len else 0) or 4096
    port = args.port or free_port(args.host)
    flavor = args.flavor if engine_name == "external" else engine_name
    spec = EngineSpec(
        model=model, served_name=served, port=port, host=args.host, max_model_len=max_len,
        adapters=_adapters(args.adapters), gpu=gpu, gpu_ids=gpu_ids, options=options,
    )
    url = args.url or f"http://{args.advertise_host or args.host}:{port}"
    worker_id = args.id or default_worker_id(engine_name, port, args.gpu)
    opts = AgentOptions(
        worker_id=worker_id, engine=flavor, spec=spec, managed=engine_name != "external", url=url,
        redis_url=args.redis_url, redis_prefix=args.redis_prefix, heartbeat_ttl_s=args.heartbeat_ttl,
        drain_grace_s=args.drain_grace, health_timeout_s=args.health_timeout,
        warmup=not args.no_warmup, engine_log=args.engine_log or None,
    )
    return opts, why


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.engine == "external" and not args.url:
        raise SystemExit("--engine external needs --url of the running engine")
    opts, why = plan(args)
    try:
        engine = get_engine(opts.engine)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.dry_run:
        for line in why:
            print(f"# {line}")
        print(f"# worker id: {opts.worker_id}")
        if opts.managed:
            env = engine.environment(opts.spec)
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(engine.command(opts.spec)))
        else:
            print(f"# attach to {opts.url} (nothing is started)")
        return
    configure_logging(args.log_level)
    sys.exit(run_agent(opts, engine))


if __name__ == "__main__":
    main()
