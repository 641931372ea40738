"""`python -m workers`: start one engine on one GPU (or attach to one) and keep it registered.

    python -m workers --engine auto --gpu 0 --model /models/qwen7b --redis-url redis://host:6379/0
    python -m workers --engine sim --sim-profile h100-7b --model demo
    python -m workers --engine external --url http://10.0.0.5:8000 --flavor vllm
    python -m workers ... --dry-run      # print the engine command and why, start nothing
    python -m workers --gpu 0 --instances 2 ...   # two engines sharing one large card
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, NoReturn

import httpx
import yaml

from fleetgate.logs import configure_logging
from fleetgate.net import free_port
from fleetgate.schema import GpuInfo
from workers.agent import run_agent
from workers.context import FALLBACK as FALLBACK_MAX_MODEL_LEN
from workers.context import default_max_model_len
from workers.engine_process import die_with_parent
from workers.engines import Engine, EngineSpec, get_engine, known_engines
from workers.gpu import DEFAULT_PROFILES, CardProfile, load_profiles, profile_for, query_gpus
from workers.options import AgentOptions, default_worker_id
from workers.preflight import check_host, check_redis

# With `--instances N` each engine gets 1/N of the card: the option that sizes its memory,
# and its value when neither the profile nor the command line sets it.
MEMORY_SHARE = {"vllm": ("gpu_memory_utilization", 0.9), "lmdeploy": ("cache_max_entry_count", 0.8)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="auto", help="auto|sim|vllm|lmdeploy|swift|external (default auto)")
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
    p.add_argument("--kv-events", default="", metavar="ENDPOINT",
                   help="--engine external: where the running vLLM publishes its KV cache events "
                        "(its --kv-events-config endpoint, e.g. tcp://127.0.0.1:5557)")
    p.add_argument("--kv-replay", default="", metavar="ENDPOINT",
                   help="--engine external: the engine's replay_endpoint (e.g. tcp://127.0.0.1:5558)")
    p.add_argument("--kv-topic", default="", help="--engine external: the engine's KV events topic")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--sim-profile", default="", help="simulated card, e.g. h100-7b, t4-7b")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option (YAML value), overrides the card profile; repeatable")
    p.add_argument("--profiles", default=str(DEFAULT_PROFILES), help="card profile file")
    p.add_argument("--nvidia-smi-output", default="", metavar="FILE",
                   help="read the cards from this saved nvidia-smi output instead of running it")
    p.add_argument("--instances", type=int, default=1,
                   help="engines to run on the card(s), each with its share of the memory")
    p.add_argument("--instance", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--id", default="", help="worker id (default: host-gpuN-engine-port)")
    p.add_argument("--redis-url", default=os.environ.get("FLEETGATE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--redis-prefix", default=os.environ.get("FLEETGATE_REDIS_PREFIX", "fleetgate"))
    p.add_argument("--heartbeat-ttl", type=float, default=3.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between load reports (published: the gateway judges a report's age by it)")
    p.add_argument("--drain-grace", type=float, default=60.0, help="seconds to wait for in-flight work")
    p.add_argument("--health-timeout", type=float, default=900.0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--speed", type=float, default=0.0,
                   help="pin the card's speed relative to an H100 with a 7B model (1.0); default: "
                   "measured from the engine's counters while it serves, seeded by the card's timing "
                   "profile, else by a probe batch timed at start")
    p.add_argument("--probe-timeout", type=float, default=1.0,
                   help="seconds each health/metrics probe of the engine may take (default 1)")
    p.add_argument("--unhealthy-after", type=int, default=3,
                   help="failed probes in a row that take the worker out of routing (default 3)")
    p.add_argument("--warmup-attempts", type=int, default=3,
                   help="tries of the warm-up before the start counts as failed (default 3)")
    p.add_argument("--engine-log", default="", help="file for the engine's output")
    p.add_argument("--log-level", default=os.environ.get("FLEETGATE_LOG_LEVEL", "info"))
    p.add_argument("--dry-run", action="store_true", help="print the engine command and exit")
    p.add_argument("--preflight", action="store_true",
                   help="as --dry-run, after checking that Redis answers and the engine's address "
                   "resolves (exit status 1 if not)")
    return p


def usage_error(message: str) -> NoReturn:
    """A mistyped option: one line on stderr and exit status 2, as argparse's own errors."""
    print(f"python -m workers: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _one_of(what: str, value: str, known: list[str]) -> str:
    """`unknown X 'v'; did you mean 'w'? known: ...` for a value not in `known`."""
    close = difflib.get_close_matches(value, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return f"unknown {what} {value!r}{hint} known: {', '.join(known)}"


def _check_options(engine_name: str, overrides: dict[str, Any]) -> None:
    """Refuse an `--option` the engine does not read: a typo would otherwise be dropped."""
    if not overrides:
        return
    if engine_name == "external":
        usage_error("--option tunes an engine the agent starts; --engine external takes none")
    known = sorted(get_engine(engine_name).options)
    for key in overrides:
        if key not in known:
            usage_error(_one_of(f"--option for the {engine_name} engine:", key, known))


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            usage_error(f"--option needs KEY=VALUE, got {pair!r}")
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


def group_id(args: argparse.Namespace, engine_name: str, port: int) -> str:
    """The worker id; with `--instances N` the id the N instances share as a prefix."""
    return args.id or default_worker_id(engine_name, args.port or port, args.gpu)


def plan(args: argparse.Namespace) -> tuple[AgentOptions, list[str]]:
    """Decide engine, card profile and spec; return the options and the reasons."""
    why: list[str] = []
    _check_engine_args(args)
    gpu_ids = tuple(g for g in args.gpu.split(",") if g)
    gpu = _find_gpu(args, gpu_ids)
    profiles = load_profiles(args.profiles)
    card: CardProfile | None = profile_for(gpu, profiles) if gpu else None
    engine_name = _choose_engine(args.engine, gpu, card, why)
    options: dict[str, Any] = dict(card.options) if card and card.engine == engine_name else {}
    if engine_name == "sim":
        sim_profile = args.sim_profile or (card.sim_profile if card else "l40s-7b")
        options = {"profile": sim_profile}
        gpu = gpu or GpuInfo(name=f"simulated {sim_profile}", profile=sim_profile, index=args.gpu)
        why.append(f"simulated card profile {sim_profile}")
    _apply_options(args, engine_name, options, why)
    model = args.model or ("fleetgate-demo-7b" if engine_name in ("sim", "external") else "")
    if not model and engine_name != "external":
        raise SystemExit(f"--model is required for --engine {engine_name}")
    served = args.served_model_name or (os.path.basename(model.rstrip("/")) if model else "")
    max_len = args.max_model_len or (card.max_model_len if card and card.max_model_len else 0)
    if not max_len and engine_name in ("sim", "external"):
        max_len = FALLBACK_MAX_MODEL_LEN  # the simulator's default; an external engine says its own
    elif not max_len:
        max_len, line = default_max_model_len(engine_name, model, options, gpu, len(gpu_ids))
        why.append(line)
    instances, instance = max(1, args.instances), args.instance or 0
    port = args.port + instance if args.port else free_port(args.host)
    flavor = args.flavor if engine_name == "external" else engine_name
    spec = EngineSpec(
        model=model, served_name=served, port=port, host=args.host, max_model_len=max_len,
        adapters=_adapters(args.adapters), gpu=gpu, gpu_ids=gpu_ids, options=options,
    )
    url = args.url or f"http://{args.advertise_host or args.host}:{port}"
    worker_id = group_id(args, engine_name, port)
    if instances > 1:
        worker_id = f"{worker_id}-{instance}"
    opts = AgentOptions(
        worker_id=worker_id, engine=flavor, spec=spec, managed=engine_name != "external", url=url,
        redis_url=args.redis_url, redis_prefix=args.redis_prefix, heartbeat_ttl_s=args.heartbeat_ttl,
        heartbeat_interval_s=max(0.05, args.heartbeat_interval), drain_grace_s=args.drain_grace, health_timeout_s=args.health_timeout,
        warmup=not args.no_warmup, engine_log=args.engine_log or None, speed=max(0.0, args.speed),
        probe_timeout_s=args.probe_timeout, unhealthy_after=args.unhealthy_after,
        warmup_attempts=max(1, args.warmup_attempts),
        kv_events=args.kv_events, kv_replay=args.kv_replay, kv_topic=args.kv_topic,
    )
    return opts, why


def _check_engine_args(args: argparse.Namespace) -> None:
    engines = known_engines()
    if args.engine not in ("auto", "external", *engines):
        usage_error(_one_of("--engine", args.engine, ["auto", "external", *engines]))
    if args.engine == "external" and args.flavor not in engines:
        usage_error(_one_of("--flavor", args.flavor, engines))


def _find_gpu(args: argparse.Namespace, gpu_ids: tuple[str, ...]) -> GpuInfo | None:
    """The first card asked for, as nvidia-smi describes it (not asked for the simulator or
    an external engine); exits when a card asked for is not there."""
    probe = args.engine not in ("sim", "external")
    gpus = {g.index: g for g in query_gpus(args.nvidia_smi_output or None)} if probe else {}
    missing = [g for g in gpu_ids if g not in gpus]
    if args.engine == "auto" and (missing or not gpu_ids):
        raise SystemExit(_no_gpu_for_auto(args.gpu, missing, list(gpus)))
    if gpus and missing:
        raise SystemExit(f"GPU {','.join(missing)} not found by nvidia-smi (it lists {','.join(gpus)})")
    return gpus.get(gpu_ids[0]) if gpu_ids else None


def _choose_engine(asked: str, gpu: GpuInfo | None, card: CardProfile | None, why: list[str]) -> str:
    """`--engine auto` takes the card profile's engine; any other is as asked."""
    if asked == "auto":
        if card is not None:
            why.append(f"{gpu.name if gpu else '?'}: profile {card.name} -> {card.engine} ({card.why})")
            return card.engine
        return asked
    if card is not None and card.engine != asked:
        why.append(f"{gpu.name if gpu else '?'}: profile {card.name} is for {card.engine}; "
                   f"{asked} runs with its own defaults")
    return asked


def _apply_options(args: argparse.Namespace, engine_name: str, options: dict[str, Any], why: list[str]) -> None:
    """The operator's --option values over the profile's (in `options`), each instance's share
    of the card's memory, and what adapters need of LMDeploy."""
    overrides = _options(args.option)
    _check_options(engine_name, overrides)
    instances = max(1, args.instances)
    if instances > 1:
        why.append(_share_memory(engine_name, options, overrides, instances, args.gpu))
    for key, value in overrides.items():
        if key in options and options[key] != value:
            why.append(f"--option {key}={value} overrides the profile's {options[key]}")
    options.update(overrides)
    if engine_name == "lmdeploy" and args.adapters and "backend" not in overrides and options.get("backend") != "pytorch":
        options["backend"] = "pytorch"
        why.append("adapters asked for: LMDeploy's PyTorch backend (TurboMind serves no LoRA adapters)")


def _no_gpu_for_auto(asked: str, missing: list[str], present: list[str]) -> str:
    """Why `--engine auto` cannot start anything, and what to run instead."""
    if not asked:
        found = f"nvidia-smi lists GPU {','.join(present)}: pick one with --gpu N" if present else (
            "and nvidia-smi finds none")
        problem = f"--engine auto needs the card to run on (--gpu N), {found}"
    elif present:
        problem = f"--engine auto: GPU {','.join(missing)} not found by nvidia-smi (it lists {','.join(present)})"
    else:
        problem = f"--engine auto: no GPU {asked} (nvidia-smi is missing or finds no card)"
    return (f"{problem}. Auto starts a real engine on a real card only. For a demo without a GPU, "
            "run the simulator explicitly: --engine sim (with --sim-profile h100-7b, say); to attach "
            "an engine that already runs: --engine external --url URL.")


def _share_memory(
    engine_name: str, options: dict[str, Any], overrides: dict[str, Any], instances: int, gpu: str
) -> str:
    """Give each of `instances` engines its share of the card's memory (in `options`)."""
    if engine_name not in MEMORY_SHARE:
        return f"{instances} {engine_name} instances on GPU {gpu or '-'}: nothing to split"
    key, default = MEMORY_SHARE[engine_name]
    if key in overrides:
        return f"{instances} instances on GPU {gpu or '-'}: each uses --option {key}={overrides[key]}"
    whole = float(options.get(key, default))
    options[key] = round(whole / instances, 3)
    # LMDeploy's fraction is of the memory left after the weights, which the first
    # instance's weights and cache shrink for the next: the split is conservative there.
    return f"{instances} instances share GPU {gpu or '-'}: {key} {whole:g} / {instances} = {options[key]:g} each"


def _engine(opts: AgentOptions) -> Engine:
    """The engine, with its command line built once so a bad combination fails here."""
    try:
        engine = get_engine(opts.engine)
        if opts.managed:
            engine.command(opts.spec)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return engine


def _preflight(opts: AgentOptions) -> None:
    """Exit with the reason when Redis does not answer or the engine's address does not resolve."""
    for problem in (check_redis(opts.redis_url), check_host(opts.base_url)):
        if problem:
            raise SystemExit(problem)


def _print_plan(opts: AgentOptions, engine: Engine) -> None:
    if opts.managed:
        env = engine.environment(opts.spec)
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(engine.command(opts.spec)))
    else:
        print(f"# attach to {opts.url} (nothing is started)")


def run_instances(argv: list[str], args: argparse.Namespace) -> int:
    """`--instances N`: one agent process per instance, started one after another.

    Each next engine starts once the previous one answers its health check, so that
    engines which size their cache from the free memory (vLLM's profiling run) never
    measure while another one is loading. Signals are passed to every agent; the exit
    code is the first non-zero one of theirs.
    """
    if args.engine == "external":
        raise SystemExit("--instances starts engines; it does not apply to --engine external")
    args.port = args.port or free_port(args.host, count=args.instances)  # instance k: port + k
    plans = [plan(argparse.Namespace(**{**vars(args), "instance": k})) for k in range(args.instances)]
    first, why = plans[0]
    engine = _engine(first)
    group = group_id(args, first.engine, args.port)
    if args.dry_run or args.preflight:
        if args.preflight:
            _preflight(first)
        _print_instances(plans, why, group, engine)
        return 0
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for k, (opts, _) in enumerate(plans):
        if stopping:
            break
        child = [sys.executable, "-m", "workers", *argv,
                 "--port", str(args.port), "--id", group, "--instance", str(k)]
        procs.append(subprocess.Popen(child, preexec_fn=die_with_parent))
        if k + 1 < len(plans):
            _wait_healthy(procs[-1], opts.url + engine.health_path, args.health_timeout, lambda: stopping)
    codes = [proc.wait() for proc in procs]
    return next((code for code in codes if code), 0)


def _print_instances(plans: list[tuple[AgentOptions, list[str]]], why: list[str], group: str, engine: Engine) -> None:
    for line in why:
        print(f"# {line}")
    print(f"# worker id: {group}")
    for k, (opts, _) in enumerate(plans):
        print(f"# instance {k + 1} of {len(plans)}: worker id {opts.worker_id}")
        _print_plan(opts, engine)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float, stop: Any) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not stop():
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.engine == "external" and not args.url:
        raise SystemExit("--engine external needs --url of the running engine")
    if args.instances < 1:
        raise SystemExit("--instances must be at least 1")
    if args.instances > 1 and args.instance is None:
        sys.exit(run_instances(argv, args))
    opts, why = plan(args)
    engine = _engine(opts)
    if args.dry_run or args.preflight:
        if args.preflight:
            _preflight(opts)
        for line in why:
            print(f"# {line}")
        print(f"# worker id: {opts.worker_id}")
        _print_plan(opts, engine)
        return
    configure_logging(args.log_level)
    sys.exit(run_agent(opts, engine))


if __name__ == "__main__":
    main()
