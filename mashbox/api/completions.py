"""POST /v1/completions: continue a plain prompt (no chat template), whole or streamed.

Rules:
- `prompt` is a string or a list of exactly one string; anything else is a 400 naming
  prompt. No template, no reasoning or tool parsing: the text is the model's text.
- `max_completion_tokens` wins over `max_tokens`; both default to the end of the context.
- Not supported, 400 naming the field: n != 1, logprobs (any value).
- Output: `text_completion` objects. The stream sends one per text delta (finish_reason
  null), then one with empty text and the finish_reason, then `data: [DONE]`; stream
  chunks carry no usage. An error after the stream started is `event: error` carrying
  the response id as request_id, then `data: [DONE]`.
- `system_fingerprint` is `seed-<seed>`: the seed the request ran with (the one given,
  or the random one drawn), so a client can rerun the same sampling.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from mashbox.api import common
from mashbox.api.chat import failed_stream
from mashbox.api.common import OPENAI, ApiContext, bad_request
from mashbox.api.generation import EventStream, Generation, GenerationError, Result
from mashbox.api.prompt import text_prompt
from mashbox.http import sse
from mashbox.http.response import json_response
from mashbox.http.sse import StreamResponse


def read_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required.", "prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request(f"prompt must be a string or a list of one string, not a list of {len(prompt)}.",
                              "prompt")
        if not isinstance(prompt[0], str):
            raise bad_request("prompt[0] must be a string.", "prompt[0]")
        return prompt[0]
    raise bad_request("prompt must be a string or a list of one string.", "prompt")


def finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def completion_json(cid: str, created: int, model: str, text: str, finish, seed: int,
                    result: Result = None) -> dict:
    obj = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
        "system_fingerprint": f"seed-{seed}",
    }
    if result is not None:
        obj["usage"] = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.total_tokens,
        }
    return obj


def parse_request(api: ApiContext, body: Any):
    body = common.require_object(body)
    common.check_model(body, api)
    if body.get("logprobs") is not None:
        common.get_int(body, "logprobs", None)
        raise bad_request("logprobs is not supported (log probabilities are not computed).", "logprobs")
    stream = common.get_bool(body, "stream", False)
    text = read_prompt(body)
    fields = common.read_sampling(body, ("max_completion_tokens", "max_tokens"))
    return text, fields, stream


async def _stream(gen: Generation, cid: str, created: int, model: str, seed: int) -> AsyncIterator[bytes]:
    try:
        async for step in gen.steps():
            text = "".join(p.text for p in step.pieces if p.kind == "text")
            if text:
                gen.output_sent = True
                yield sse.data(completion_json(cid, created, model, text, None, seed))
            if step.finished:
                yield sse.data(completion_json(cid, created, model, "", finish_reason(gen.result), seed))
                yield sse.DONE
                return
    except GenerationError as exc:
        for frame in failed_stream(exc, cid):
            yield frame


def routes(api: ApiContext) -> list:
    async def completions(req):
        body = common.request_body(api, req, OPENAI)
        text, fields, stream = parse_request(api, body)
        prompt = text_prompt(api, text, fields.max_tokens)
        cid = common.new_id("cmpl-")
        gen = Generation(api, prompt, fields, OPENAI, tenant=req.tenant, request_id=cid)
        gen.submit()
        created = common.now()
        seed = fields.sampling.seed
        if stream:
            return StreamResponse(EventStream(_stream(gen, cid, created, api.model_id, seed), gen))
        result = await gen.run()
        return json_response(completion_json(cid, created, api.model_id, result.text, finish_reason(result),
                                             seed, result))

    return [("POST", "/v1/completions", completions, OPENAI)]
