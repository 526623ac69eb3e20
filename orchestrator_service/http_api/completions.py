"""Completions (`/v1/completions`, the plain-LM API that benchmark and eval tools call): the body, its
translation to the request path, and the answer as a `text_completion` object or as streamed chunks.

A completion is the prompt as written: the request path's `raw_prompt` (no chat template), or the client's
token ids as given; text is the only output, so a pipeline without text out is refused (`model`). Every
choice is one request down the request path, all at once, each admitted on its own (as images): a list of
prompts is one choice each, and `n` choices of a prompt are `n` requests seeded seed, seed + 1, ... (a
random base seed when none is given and n > 1, so that sampled choices differ). Choice `i * n + j` is
prompt i's j-th, as the reference numbers them. A stream carries one choice: several are refused.

Stop strings end a choice's text before them and cancel the rest of its request (stop.py), as in chat;
`echo` puts the prompt's text before the answer (a token-id prompt has no text here: the orchestrator holds
no tokenizer, so echo is refused with one). The engines give no log probabilities, so `logprobs` is refused.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Annotated, AsyncIterator, Callable

from pydantic import ConfigDict, Field

from omnistage.api import Limits, Pipeline
from omnistage.contract.params import InvalidRequest
from omnistage.contract.request import build_request
from omnistage.v1 import orchestrator_pb2

from .body_limits import BODY_SLACK, ESCAPES_PER_CHAR, JSON_BYTES_PER_CHAR, VALUES_SLACK, BodyBounds
from .call import Call, ClientGone, run_all
from .chat import finish_reason, usage, usage_event
from .errors import ApiError
from .responses import SSE_DONE, TRACE_FIELD, sse_event, trace_dict, with_trace
from .schemas import UINT32, UINT64, Body, BuiltOnce, Name, StopString, StreamOptions
from .stop import StopWatch
from .translate import Translated, check_model, pipeline_outputs
from .translate import _stops as stops_of  # chat's: the same rules, the same messages

# Choices of one request (prompts times n): each is a request down the request path, admitted on its own;
# as many as a request may hold at once without one body filling a pipeline's admission (images allow 10).
MAX_CHOICES = 16
INT32 = 2**31 - 1  # a token id on the request path (GenerationParams.prompt_token_ids is int32)
TOKEN_ID_JSON_BYTES = 12  # a token id at its longest in JSON: "2147483647, "
# The reference's fields this API cannot honour, refused when a request asks for them (set to a value that
# asks for nothing they pass: null, 0, {}, and best_of 1).
REFUSED_FIELDS = {
    "logprobs": "log probabilities are not returned (the engines give none)",
    "suffix": "insertion (text after the completion) is not supported: the model continues the prompt only",
    "best_of": "best_of needs log probabilities to rank the choices, which the engines do not give: ask for n "
               "choices instead",
    "logit_bias": "logit bias is not supported",
    "presence_penalty": "presence penalty is not supported",
    "frequency_penalty": "frequency penalty is not supported",
}
_OFF = {"best_of": (None, 1), "logprobs": (None,)}  # logprobs 0 still asks for the sampled tokens' own
_OFF_DEFAULT: tuple = (None, 0, {})  # 0.0 and False are 0

TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32)]], Field(fail_fast=True)]
# prompt: a text, a token-id list, or a list of either (one choice each)
Prompt = Annotated[str | TokenIds | Annotated[list[str], Field(fail_fast=True)] |
                   Annotated[list[TokenIds], Field(fail_fast=True)], BuiltOnce]


class CompletionRequest(Body):
    # Unknown fields are kept (and otherwise ignored): the reference's fields this API cannot honour are
    # among them, refused by name (REFUSED_FIELDS) when a request asks for them.
    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    stop: Annotated[StopString | Annotated[list[StopString], Field(fail_fast=True)] | None, BuiltOnce] = None
    n: int | None = Field(None, ge=1)  # with the prompts, at most MAX_CHOICES: checked where it is counted
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=UINT32)  # -1 or 0: off
    ignore_eos: bool | None = None
    return_trace: bool | None = None  # omnistage's: the per-stage trace in the answer


def bounded(limits: Limits) -> type[CompletionRequest]:
    """The body under a pipeline's limits: each prompt at most `maxPromptChars` characters or token ids (the
    request path checks the same again), at most MAX_CHOICES prompts."""
    text = Annotated[str, Field(max_length=limits.max_prompt_chars)]
    ids = Annotated[list[Annotated[int, Field(ge=0, le=INT32)]],
                    Field(max_length=limits.max_prompt_chars, fail_fast=True)]

    texts = Annotated[list[text], Field(max_length=MAX_CHOICES, fail_fast=True)]
    id_lists = Annotated[list[ids], Field(max_length=MAX_CHOICES, fail_fast=True)]

    class BoundedCompletion(CompletionRequest):
        prompt: Annotated[text | ids | texts | id_lists, BuiltOnce]

    return BoundedCompletion


def body_bounds(limits: Limits) -> BodyBounds:
    """The largest body the limits admit: MAX_CHOICES prompts at their longest (as escaped text or token ids)."""
    prompts = MAX_CHOICES * limits.max_prompt_chars
    return BodyBounds(prompts * max(JSON_BYTES_PER_CHAR, TOKEN_ID_JSON_BYTES) + BODY_SLACK, prompts + VALUES_SLACK,
                      ESCAPES_PER_CHAR * prompts + VALUES_SLACK)


# ------------------------------------------------------------------------ translation

@dataclasses.dataclass(frozen=True)
class ChoicePlan(Translated):
    """One choice's request, and what its answer needs beyond chat's: its index and the text echoed."""

    index: int = 0
    echo: str = ""


def translate(body: CompletionRequest, pipeline: Pipeline,
              random_seed: Callable[[], int] = lambda: secrets.randbelow(2**32)) -> list[ChoicePlan]:
    """One request per choice, in the reference's order (prompt by prompt, n of each)."""
    check_model(body.model, pipeline)
    has = pipeline_outputs(pipeline)
    if "text" not in has:
        raise InvalidRequest("model", f'"{pipeline.name}" answers with {", ".join(has)}, not text (completions '
                                      "need a text output)")
    asked = body.model_extra or {}
    for name, why in REFUSED_FIELDS.items():
        if asked.get(name) not in _OFF.get(name, _OFF_DEFAULT):
            raise InvalidRequest(name, why)
    prompts = _prompts(body.prompt)
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequest("n", f"{len(prompts)} prompt(s) with n={n} are {len(prompts) * n} choices; at most "
                                  f"{MAX_CHOICES} in one request")
    if body.stream and len(prompts) * n > 1:
        raise InvalidRequest("stream", f"a stream carries one choice (this request has {len(prompts) * n}: "
                                       f"{len(prompts)} prompt(s), n={n}); send one streamed request each")
    stops = stops_of(body.stop)
    seed = body.seed if body.seed is not None else (random_seed() if n > 1 else None)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    plans = []
    for i, (prompt, param) in enumerate(prompts):
        if body.echo and not isinstance(prompt, str):
            raise InvalidRequest("echo", "echoes a text prompt only: this server holds no tokenizer to write "
                                         f"{param}'s token ids as text (send the prompt as text)")
        fields = {"params.prompt": param, "params.prompt_token_ids": param, "params.text.max_tokens": "max_tokens",
                  "params.text.temperature": "temperature", "params.text.top_p": "top_p",
                  "params.text.top_k": "top_k", "params.seed": "seed"}
        for j in range(n):
            request = build_request(
                prompt if isinstance(prompt, str) else "", prompt_token_ids=() if isinstance(prompt, str) else prompt,
                raw_prompt=True, max_tokens=body.max_tokens or 0, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k if body.top_k and body.top_k > 0 else None,
                seed=None if seed is None else (seed + j) % (UINT64 + 1), ignore_eos=bool(body.ignore_eos),
                outputs=["text"], return_trace=bool(body.return_trace))
            plans.append(ChoicePlan(request, fields, stops=stops, stream=bool(body.stream),
                                    include_usage=include_usage, index=i * n + j,
                                    echo=prompt if body.echo and isinstance(prompt, str) else ""))
    return plans


def _prompts(prompt: str | list) -> list[tuple[str | list[int], str]]:
    """The prompts as (text or token ids, the field that names it)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        listed = [(prompt, "prompt")]
    elif not prompt:
        raise InvalidRequest("prompt", "is empty")
    else:
        listed = [(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    for p, param in listed:
        if not p:
            raise InvalidRequest(param, "is empty")
    return listed


# ------------------------------------------------------------------------ the answer

@dataclasses.dataclass
class Choice:
    """One choice's answer as it came: its text (stops applied), final event and tokens seen."""

    text: str
    final: orchestrator_pb2.Final | None
    tokens: int
    stopped: bool


async def _choice(call: Call, plan: ChoicePlan) -> Choice:
    watch = StopWatch(plan.stops)
    text: list[str] = []
    final, tokens = None, 0
    async for ev in call:
        kind = ev.WhichOneof("event")
        if kind == "text":
            tokens += len(ev.text.token_ids)
            text.append(watch.feed(ev.text.text))
            if watch.stopped:
                break
        elif kind == "final":
            final = ev.final
    return Choice(plan.echo + "".join(text) + watch.flush(), final, tokens, watch.stopped)


def completion_id(call: Call) -> str:
    return f"cmpl-{call.request_id}"


async def complete(calls: list[Call], plans: list[ChoicePlan], model: str) -> dict:
    """Every choice at once, as one `text_completion`; usage counts each prompt once, as the reference does."""
    plan_of = dict(zip(calls, plans))
    choices: list[Choice] = await run_all(calls, lambda call: _choice(call, plan_of[call]))
    prompt_tokens: dict[str, int] = {}  # by the field that names the prompt (prompt[i]): n choices share it
    completion_tokens = 0
    for plan, c in zip(plans, choices):
        counted = usage(c.final, c.tokens)
        key = plan.fields["params.prompt"]
        prompt_tokens[key] = max(prompt_tokens.get(key, 0), counted["prompt_tokens"])  # 0 when a stop cut it
        completion_tokens += counted["completion_tokens"]
    prompt = sum(prompt_tokens.values())
    answer = {"id": completion_id(calls[0]), "object": "text_completion", "created": int(time.time()), "model": model,
              "system_fingerprint": None,
              "choices": [{"text": c.text, "index": p.index, "logprobs": None,
                           "finish_reason": finish_reason(c.final, c.stopped)} for p, c in zip(plans, choices)],
              "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                        "total_tokens": prompt + completion_tokens}}
    if len(choices) == 1:
        return with_trace(answer, choices[0].final)
    traces = [trace_dict(c.final) for c in choices]
    if any(t is not None for t in traces):  # one per choice, in order (as images)
        answer[TRACE_FIELD] = traces
    return answer


async def stream(call: Call, plan: ChoicePlan, model: str) -> AsyncIterator[bytes]:
    """The one choice as it appears: text chunks (the echo first), a chunk with the finish reason (and the
    trace when asked for), a usage chunk when asked for, `[DONE]`. A failure after the first event is one
    error event, and the stream ends."""
    cid, created = completion_id(call), int(time.time())

    def chunk(text: str, reason: str | None = None, final: orchestrator_pb2.Final | None = None) -> bytes:
        obj: dict = {"id": cid, "object": "text_completion", "created": created, "model": model,
                     "system_fingerprint": None,
                     "choices": [{"text": text, "index": plan.index, "logprobs": None, "finish_reason": reason}]}
        if plan.include_usage:
            obj["usage"] = None
        return sse_event(with_trace(obj, final))

    watch = StopWatch(plan.stops)
    final, tokens = None, 0
    try:
        if plan.echo:
            yield chunk(plan.echo)
        async for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "text":
                tokens += len(ev.text.token_ids)
                if piece := watch.feed(ev.text.text):
                    yield chunk(piece)
                if watch.stopped:
                    break
            elif kind == "final":
                final = ev.final
        yield chunk(watch.flush(), finish_reason(final, watch.stopped), final)
        if plan.include_usage:
            yield usage_event("text_completion", cid, created, model, final, tokens)
        yield SSE_DONE
    except ApiError as e:
        yield sse_event(e.body())
    except ClientGone:
        return
