"""POST /v1/completions: continue a plain prompt (no chat template), whole or streamed.

Rules:
- `prompt` is a string or a list of exactly one string; anything else is a 400 naming
  prompt. No template, no reasoning or tool parsing: the text is the model's text.
- `max_completion_tokens` wins over `max_tokens`; both default to the end of the context.
- Not supported, 400 naming the field: n != 1.
- `logprobs` (0-20): the legacy logprobs object (tokens, token_logprobs, top_logprobs,
  text_offset) on each choice, per chunk when streamed (api/logprobs.py).
- Output: `text_completion` objects. The stream sends one per text delta (finish_reason
  null), then one with empty text and the finish_reason, then `data: [DONE]`; stream
  chunks carry no usage. An error after the stream started is `event: error` carrying
  the response id as request_id, then `data: [DONE]`.
- `system_fingerprint` is `seed-<seed>`: the seed the request ran with (the one given,
  or the random one drawn), so a client can rerun the same sampling.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from mashbox.api import common, logprobs, pipeline
from mashbox.api.chat_answer import OpenAIWriter
from mashbox.api.common import OPENAI, ApiContext, bad_request
from mashbox.api.generation import Piece, Result
from mashbox.api.logprobs import LegacyLogprobs
from mashbox.api.pipeline import ApiRequest
from mashbox.api.prompt import Prompt
from mashbox.http import sse


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
                    result: Optional[Result] = None, logprobs: Optional[dict] = None) -> dict:
    obj = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        "system_fingerprint": f"seed-{seed}",
    }
    if result is not None:
        obj["usage"] = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.total_tokens,
        }
    return obj


class CompletionWriter(OpenAIWriter):
    """The pipeline.Writer of a Completions answer: one text_completion per step's text."""

    def __init__(self, cid: str, created: int, model: str, seed: int, logprobs: bool = False):
        self.id, self.created, self.model, self.seed = cid, created, model, seed
        self.logprobs = LegacyLogprobs() if logprobs else None

    def _object(self, text: str, finish: Optional[str], result: Optional[Result] = None,
                logprobs: Optional[dict] = None) -> dict:
        return completion_json(self.id, self.created, self.model, text, finish, self.seed, result, logprobs)

    def start_frames(self, result: Result) -> list[bytes]:
        return []

    def step_frames(self, pieces: list[Piece]) -> list[bytes]:
        text = "".join(p.text for p in pieces if p.kind == "text")
        if self.logprobs is None:
            return [sse.data(self._object(text, None))] if text else []
        entries = tuple(e for p in pieces for e in p.logprobs)
        if not (text or entries):
            return []
        return [sse.data(self._object(text, None, logprobs=self.logprobs.json(entries)))]

    def end_frames(self, result: Result) -> list[bytes]:
        return [sse.data(self._object("", finish_reason(result))), sse.DONE]

    def whole(self, result: Result) -> dict:
        lp = self.logprobs.json(result.logprobs) if self.logprobs is not None else None
        return self._object(result.text, finish_reason(result), result, lp)


def convert(api: ApiContext, body: Any) -> ApiRequest:
    body = common.require_object(body)
    model = common.check_model(body, api)
    top = logprobs.read_completions(body)
    stream = common.get_bool(body, "stream", False)
    text = read_prompt(body)
    fields = dataclasses.replace(common.read_sampling(body, ("max_completion_tokens", "max_tokens")), logprobs=top)
    return ApiRequest(fields=fields, stream=stream, text=text, model=model)


def writer(api: ApiContext, request: ApiRequest, prompt: Prompt, answer_id: str) -> CompletionWriter:
    return CompletionWriter(answer_id, common.now(), request.model or api.model_id, request.fields.sampling.seed,
                            request.fields.logprobs is not None)


SURFACE = pipeline.Surface("/v1/completions", OPENAI, "cmpl-", convert, writer)


def routes(api: ApiContext) -> list:
    return [pipeline.route(api, SURFACE)]
