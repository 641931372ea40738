"""How much of a prompt each worker's engine holds in its prefix cache (precise prefix routing).

The agents publish each engine's cached blocks from its KV cache events, keyed by
fleetgate's chain keys over the blocks' token ids (fleetgate/kv_index.py); every gateway
mirrors them (fleetgate/kv_registry.py `KvMirror`). To look a request up, the gateway needs
the token ids the engine will prefill: the model's chat template rendered as vLLM renders it
(fleetgate/chat_template.py), tokenized with the model's tokenizer (gateway/request/tokenizers.py).
Where that cannot be exact, the request is not looked up and the placement decides, as it
does for workers that publish no events:

- no tokenizer for the model, or no chat template beside it (for a chat);
- a request that brings what the gateway does not render (tools, documents, its own
  template or template arguments, tool calls in its messages), images, the Responses API,
  several prompts in one completion;
- an adapter's request (the adapters' placement decides; their blocks are apart anyway).

The look-up is in memory: no Redis on the request path. Rendering and tokenizing are done
only when a worker that can serve the request publishes a usable index; the template is
rendered whole for each request, but only the text between its special tokens that was not
seen lately is tokenized (gateway/request/token_pieces.py): the ids are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import msgspec
import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetgate.chat_template import ChatTemplate, load_chat_template
from fleetgate.kv_index import chain_keys
from fleetgate.kv_registry import KvMirror, WorkerKv
from gateway.request.requests import TokenCounter, separate_prompts
from gateway.request.token_pieces import PieceTokenizer
from gateway.routing.table import Slot
from gateway.wire import Message, Probe

log = structlog.get_logger("gateway.prefix_cache")

__all__ = ["KvIndexCollector", "PrefixCache", "PromptTokens"]


def _given(raw: msgspec.Raw) -> bool:
    return bytes(raw) not in (b"", b"null")


class PromptTokens:
    """The token ids an engine prefills for a request, with one model's tokenizer and template."""

    def __init__(self, counter: TokenCounter, template: ChatTemplate | None, *, cut: bool = True) -> None:
        self.tokenizer = counter.tokenizer
        self.template = template
        # A chat's rendered text, tokenized piece by piece between the template's special
        # tokens, the pieces' ids kept: a repeated system prompt is tokenized once.
        self.pieces = PieceTokenizer(self.tokenizer, cut=cut)

    def ids(self, probe: Probe) -> list[int] | None:
        """The prompt's token ids, or None where the gateway cannot know them exactly."""
        if probe.messages is not None:
            return self._chat(probe)
        if probe.input is not None:
            return None  # the Responses API: the engine builds its own conversation
        prompts = separate_prompts(probe.prompt)
        if len(prompts) != 1:
            return None
        prompt = prompts[0]
        if isinstance(prompt, list):
            return prompt if all(isinstance(t, int) for t in prompt) else None
        return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)

    def _chat(self, probe: Probe) -> list[int] | None:
        if self.template is None or not probe.messages:
            return None
        if any(_given(r) for r in (probe.tools, probe.chat_template, probe.chat_template_kwargs, probe.documents)):
            return None
        add = bytes(probe.add_generation_prompt)
        cont = bytes(probe.continue_final_message)
        if add not in (b"", b"null", b"true", b"false") or cont not in (b"", b"null", b"true", b"false"):
            return None
        messages = [m for msg in probe.messages if (m := _message(msg)) is not None]
        if len(messages) != len(probe.messages):
            return None
        try:
            text = self.template.render(messages, add_generation_prompt=add != b"false",
                                        continue_final_message=cont == b"true")
        except Exception as exc:  # a template that refuses these messages: the engine will say so
            log.debug("gateway.template_refused", error=str(exc)[:200])
            return None
        return self.pieces.encode(text)


def _message(msg: Message) -> dict[str, object] | None:
    """A message as vLLM hands it to the template; None for one the gateway cannot render."""
    if _given(msg.tool_calls) or _given(msg.name) or msg.output is not None:
        return None
    content = msg.content
    if isinstance(content, list):
        if any(p.text is None for p in content):
            return None  # an image, audio, a file: the engine renders placeholders
        return {"role": msg.role, "content": [{"type": "text", "text": p.text} for p in content]}
    return {"role": msg.role, "content": content}


class PrefixCache:
    """Looks requests up in the workers' KV indexes (`mirror`). `cut_pieces` False: chats are
    tokenized whole every time (the old path, for scripts/bench_prefix_tokens.py)."""

    def __init__(self, mirror: KvMirror, *, cut_pieces: bool = True) -> None:
        self.mirror = mirror
        self.cut_pieces = cut_pieces
        self._prompts: dict[int, PromptTokens] = {}  # id(counter) -> its prompt builder
        self._counters: list[TokenCounter] = []  # keeps the ids above meaning one counter

    def held(self, slots: Sequence[Slot], counter: TokenCounter, probe: Probe) -> tuple[int | None, dict[str, int]]:
        """(the prompt's exact token count, or None; worker -> prompt tokens its engine holds,
        for every worker whose index is known, 0 for one that holds none of it)."""
        indexes: list[tuple[str, WorkerKv]] = []
        for s in slots:
            wkv = self.mirror.get(s.id)
            if wkv is not None and wkv.block_size > 0:
                indexes.append((s.id, wkv))
        if not indexes:
            return None, {}
        ids = self._builder(counter).ids(probe)
        if ids is None:
            return None, {}
        held: dict[str, int] = {}
        keys_by_size: dict[int, list[int]] = {}
        for wid, wkv in indexes:
            if not wkv.keys:  # holds nothing: no keys to compute for it
                held[wid] = 0
                continue
            size = wkv.block_size
            keys = keys_by_size.get(size)
            if keys is None:
                keys = keys_by_size[size] = chain_keys(ids, size)
            held[wid] = wkv.cached_blocks(keys) * size
        return len(ids), held

    def _builder(self, counter: TokenCounter) -> PromptTokens:
        found = self._prompts.get(id(counter))
        if found is None:
            template = None
            try:
                template = load_chat_template(Path(counter.path).parent)
            except Exception as exc:  # unreadable, or a template Jinja cannot compile
                log.warning("gateway.chat_template_unusable", path=counter.path, error=str(exc)[:200])
            found = self._prompts[id(counter)] = PromptTokens(counter, template, cut=self.cut_pieces)
            self._counters.append(counter)
        return found


class KvIndexCollector(Collector):
    """Each worker's index as this gateway mirrors it, at each scrape: whether its events can be
    trusted (1) or were lost (0: routing falls back to the placement for it), and its blocks.
    Workers that publish no events have no series."""

    def __init__(self, mirror: KvMirror, workers: Callable[[], Collection[str]]) -> None:
        self.mirror = mirror
        self.workers = workers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("fleetgate_worker_kv_events_up", "1 while the worker's KV cache events "
                               "follow its engine (precise prefix routing), 0 when they were lost.",
                               labels=["worker"])
        blocks = GaugeMetricFamily("fleetgate_worker_kv_index_blocks",
                                   "Blocks in the worker's prefix-cache index, as this gateway mirrors it.",
                                   labels=["worker"])
        for wid in sorted(self.workers()):
            wkv = self.mirror.status(wid)
            if wkv is None:
                continue
            up.add_metric([wid], 1.0 if wkv.usable else 0.0)
            blocks.add_metric([wid], float(len(wkv.keys)))
        yield up
        yield blocks
