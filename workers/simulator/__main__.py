"""`python -m workers.simulator`: a simulated vLLM (or LMDeploy) OpenAI server."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from aiohttp import web

from workers.simulator.config import SimConfig, parse_fault_args
from workers.simulator.server import create_app
from workers.timing import PROFILES


def _lora_module(text: str) -> tuple[str, str]:
    """vLLM's `name=path`, or its JSON form {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        obj = json.loads(text)
        return str(obj["name"]), str(obj["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def _profile_params(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--profile-param wants FIELD=VALUE, got {pair!r}")
        out[key.strip()] = float(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.simulator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--model", default=None, help="a folder with tokenizer.json, or a name")
    p.add_argument("--profile", default="l40s-7b", choices=sorted(PROFILES))
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=None,
        dest="num_gpu_blocks", help="KV cache blocks (vLLM's --num-gpu-blocks-override)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters held in host memory (as vLLM's; default: --max-loras)")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[])
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flavor", choices=("vllm", "lmdeploy"), default="vllm")
    p.add_argument(
        "--runner", choices=("auto", "generate", "pooling"), default="auto",
        help="as vLLM's: pooling serves /v1/embeddings instead of generation",
    )  # fmt: skip
    p.add_argument(
        "--convert", choices=("auto", "none", "embed"), default="auto",
        help="as vLLM's: embed turns the causal LM into an embedding model (implies pooling)",
    )  # fmt: skip
    p.add_argument(
        "--enable-responses-store", action="store_true",
        default=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") not in ("", "0"),
        help="store /v1/responses results (default: vLLM's VLLM_ENABLE_RESPONSES_API_STORE)",
    )  # fmt: skip
    p.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="as vLLM's: publish KV cache events over ZMQ, e.g. "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}',
    )  # fmt: skip
    p.add_argument("--fault", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--profile-param", action="append", default=[], metavar="FIELD=VALUE",
        help="override one field of the profile, e.g. base_step_s=0.004 (repeatable)",
    )  # fmt: skip
    return p


def config_from_args(argv: list[str] | None = None) -> SimConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return SimConfig(
            served_model_name=args.served_model_name,
            model=args.model,
            host=args.host,
            port=args.port,
            profile=args.profile,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
            lora_modules=dict(args.lora_modules),
            time_scale=args.time_scale,
            seed=args.seed,
            flavor=args.flavor,
            responses_store=args.enable_responses_store,
            runner=args.runner,
            convert=args.convert,
            kv_events_config=args.kv_events_config,
            faults=parse_fault_args(args.fault),
            profile_overrides=_profile_params(args.profile_param),
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    config = config_from_args(argv)
    web.run_app(
        create_app(config),
        host=config.host,
        port=config.port,
        # Like vLLM: SIGTERM stops serving within a second or two, open streams are cut.
        shutdown_timeout=1.0,
        # A client that disconnects cancels its handler, which aborts its sequence.
        handler_cancellation=True,
        access_log=None,
        print=functools.partial(print, file=sys.stderr, flush=True),
    )


if __name__ == "__main__":
    main()
