"""What every API route shares: the served context, field validation, sampling fields, errors.

Rules:
- A request body is a JSON object; every field a route reads goes through one of the
  readers below, which raise `HTTPError(400, ...)` whose message and `param` name the
  field (dotted path, e.g. `messages[2].content[0].type`). Fields a route does not read
  are ignored (the spec accepts unknown fields).
- JSON booleans are not numbers here: `"max_tokens": true` is a wrong type.
- Errors are values: `HTTPError(status, message, type, code, param, headers)`; the router
  formats them in the route family's shape. Which type / code / status a condition gets
  depends on the family, so the helpers take the family:

      condition                 openai                         anthropic
      bad field                 400 invalid_request_error      400 invalid_request_error
      other model id            404 not_found_error            (any model accepted)
                                    code model_not_found
      tenant queue full         429 rate_limit_error           429 rate_limit_error
      total queue full          429 rate_limit_error           529 overloaded_error
      not ready (loading)       503 server_error               529 overloaded_error
      failed on the device      500 server_error               500 api_error

  429 / 503 / 529 carry Retry-After; not-ready answers also carry x-should-retry: true.
"""
from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from mashbox.config import EngineConfig, SamplingParams, ServerConfig
from mashbox.api.prompt_pool import PromptPool
from mashbox.api.shutdown import Shutdown
from mashbox.engine.interface import Engine, EngineInfo, NotReady, QueueFull
from mashbox.http.response import HTTPError

if TYPE_CHECKING:  # text/ is loaded by app.py; the annotations only name its types
    from mashbox.text.chat import ChatTemplate
    from mashbox.text.tokenizer import Tokenizer

OPENAI = "openai"
ANTHROPIC = "anthropic"
FAMILIES = (OPENAI, ANTHROPIC)

RETRY_AFTER_QUEUE_S = 1  # a slot frees within a generation; ask again soon
RETRY_AFTER_LOADING_S = 5  # loading a model takes seconds to minutes

_MISSING = object()


# ---------------------------------------------------------------------------------------
# The served context
# ---------------------------------------------------------------------------------------


@dataclass
class ApiContext:
    """Everything a route handler needs, built once by app.py.

    `engine` is what engine/interface.py calls an Engine (the EngineClient, or the api
    tests' scripted double); `tokenizer` and `template` are loaded in the server process
    from the model path.
    """

    server_config: ServerConfig
    engine_config: EngineConfig
    engine: Engine
    tokenizer: "Tokenizer"
    template: "ChatTemplate"
    started_at: float = field(default_factory=time.time)
    # where big bodies are prepared (api/prompt_pool.py); None: every body inline
    prompt_pool: Optional[PromptPool] = None
    # draining / ended at shutdown (api/shutdown.py; app.py drives it, pipeline.py reads it)
    shutdown: Shutdown = field(default_factory=Shutdown)

    @property
    def info(self) -> Optional[EngineInfo]:
        """What the worker measured, once it was ready (None before)."""
        return self.engine.info

    @property
    def model_id(self) -> str:
        info = self.engine.info
        return (info.model_id if info is not None else "") or self.engine_config.model_id

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request may give as `model`: the id, then the --alias names."""
        return (self.model_id,) + tuple(a for a in self.server_config.aliases if a != self.model_id)

    @property
    def ready(self) -> bool:
        return self.engine.state == "ok"

    @property
    def ctx(self) -> int:
        """Tokens per slot: the worker's measured value once ready, else the configured one."""
        info = self.engine.info
        ctx = (info.ctx if info is not None else 0) or self.engine_config.ctx
        if not ctx:
            raise not_ready_error(OPENAI)
        return int(ctx)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def bad_request(message: str, param: Optional[str] = None, family: str = OPENAI) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", code=None, param=param)


def model_not_found(model: str, served: str) -> HTTPError:
    return HTTPError(
        404,
        f"The model {model!r} does not exist: this server serves {served!r} (GET /v1/models).",
        "not_found_error",
        code="model_not_found",
        param="model",
    )


def queue_full_error(scope: str, family: str) -> HTTPError:
    """QueueFull(scope) -> 429 (tenant cap; total cap on OpenAI routes) or 529 (Anthropic, total)."""
    headers = {"retry-after": str(RETRY_AFTER_QUEUE_S)}
    if scope == "total":
        message = "The server's queue is full (too many requests waiting for a slot); retry later."
        if family == ANTHROPIC:
            headers["x-should-retry"] = "true"
            return HTTPError(529, message, "overloaded_error", headers=headers)
    else:
        message = "Too many of your requests are waiting for a slot; retry later."
    return HTTPError(429, message, "rate_limit_error", code="rate_limit_exceeded", headers=headers)


def not_ready_error(family: str) -> HTTPError:
    """NotReady -> 503 (OpenAI) / 529 overloaded_error (Anthropic), both with x-should-retry."""
    headers = {"retry-after": str(RETRY_AFTER_LOADING_S), "x-should-retry": "true"}
    message = "The model is still loading; retry later."
    if family == ANTHROPIC:
        return HTTPError(529, message, "overloaded_error", headers=headers)
    return HTTPError(503, message, "server_error", code="model_loading", headers=headers)


def device_error(message: str, family: str) -> HTTPError:
    if family == ANTHROPIC:
        return HTTPError(500, message, "api_error")
    return HTTPError(500, message, "server_error", code="internal_error")


def engine_error(exc: QueueFull | NotReady, family: str) -> HTTPError:
    """Map the engine's QueueFull / NotReady (engine/interface.py) to the family's HTTPError."""
    if isinstance(exc, QueueFull):
        return queue_full_error(exc.scope, family)
    if isinstance(exc, NotReady):
        return not_ready_error(family)
    raise TypeError(f"engine_error: {type(exc).__name__} is not an engine refusal") from exc


def require_ready(api: ApiContext, family: str) -> None:
    if not api.ready:
        raise not_ready_error(family)


def check_model(body: dict, api: ApiContext) -> str:
    """OpenAI routes: the model name the answer repeats. A name the server serves (its id
    or an --alias) is repeated as given; none given is the id; any other name is 404."""
    model = body.get("model")
    if model is None:
        return api.model_id
    if not isinstance(model, str):
        raise bad_request("model must be a string.", "model")
    if model not in api.served_names:
        raise model_not_found(model, api.model_id)
    return model


# ---------------------------------------------------------------------------------------
# Field readers
# ---------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def require_object(body: Any, param: str = "body") -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {_type_name(body)}.", None)
    return body


def get_bool(obj: dict, name: str, default: Any = None, param: Optional[str] = None) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        p = param or name
        raise bad_request(f"{p} must be a boolean, not {_type_name(value)}.", p)
    return value


def get_str(obj: dict, name: str, default: Any = None, param: Optional[str] = None,
            choices: Optional[tuple[str, ...]] = None) -> Any:
    value = obj.get(name)
    p = param or name
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"{p} must be a string, not {_type_name(value)}.", p)
    if choices is not None and value not in choices:
        raise bad_request(f"{p} must be one of {', '.join(choices)}, not {value!r}.", p)
    return value


def get_object(obj: dict, name: str, default: Any = None, param: Optional[str] = None) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, dict):
        p = param or name
        raise bad_request(f"{p} must be an object, not {_type_name(value)}.", p)
    return value


def get_list(obj: dict, name: str, default: Any = None, param: Optional[str] = None) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, list):
        p = param or name
        raise bad_request(f"{p} must be an array, not {_type_name(value)}.", p)
    return value


def get_int(obj: dict, name: str, default: Any = None, lo: Optional[int] = None,
            hi: Optional[int] = None, param: Optional[str] = None) -> Any:
    """An integer in [lo, hi]. 3.0 is accepted as 3 (JSON has one number type); 3.5 is not."""
    value = obj.get(name)
    p = param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{p} must be an integer, not {_type_name(value)}.", p)
    if isinstance(value, float):
        if not value.is_integer():
            raise bad_request(f"{p} must be an integer, not {value!r}.", p)
        value = int(value)
    if lo is not None and value < lo:
        raise bad_request(f"{p} must be >= {lo}, not {value}.", p)
    if hi is not None and value > hi:
        raise bad_request(f"{p} must be <= {hi}, not {value}.", p)
    return value


def get_number(obj: dict, name: str, default: Any = None, lo: Optional[float] = None,
               hi: Optional[float] = None, lo_open: bool = False, hi_open: bool = False,
               param: Optional[str] = None) -> Any:
    """A finite number in the range; lo_open / hi_open exclude the bound itself."""
    value = obj.get(name)
    p = param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{p} must be a number, not {_type_name(value)}.", p)
    value = float(value)
    if not math.isfinite(value):
        raise bad_request(f"{p} must be a finite number.", p)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise bad_request(f"{p} must be {'>' if lo_open else '>='} {_fmt(lo)}, not {_fmt(value)}.", p)
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise bad_request(f"{p} must be {'<' if hi_open else '<='} {_fmt(hi)}, not {_fmt(value)}.", p)
    return value


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


# ---------------------------------------------------------------------------------------
# Sampling fields (shared by every generating route)
# ---------------------------------------------------------------------------------------

SEED_MASK = (1 << 63) - 1  # seeds travel as non-negative int64; any client int maps onto one


@dataclass(frozen=True)
class SamplingFields:
    """The generating fields common to all four routes, validated."""

    sampling: SamplingParams
    stops: tuple[str, ...]
    max_tokens: Optional[int]  # what the client asked for; None = to the end of the context
    seed_given: bool
    # log probabilities: None = off, else the top alternatives per token (0 .. 20); each
    # route reads its own fields for it (api/logprobs.py)
    logprobs: Optional[int] = None


def read_stops(body: dict) -> tuple[str, ...]:
    """`stop` (string or array of non-empty strings), else `stop_sequences` (array)."""
    name = "stop" if body.get("stop") is not None else "stop_sequences"
    value = body.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
        if name == "stop_sequences":
            raise bad_request("stop_sequences must be an array of strings, not a string.", name)
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a string or an array of strings, not {_type_name(value)}.", name)
    stops = []
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise bad_request(f"{name}[{i}] must be a string, not {_type_name(s)}.", f"{name}[{i}]")
        if s == "":
            raise bad_request(f"{name}[{i}] must not be empty.", f"{name}[{i}]")
        if s not in stops:
            stops.append(s)
    return tuple(stops)


def read_max_tokens(body: dict, names: tuple[str, ...]) -> Optional[int]:
    """The first of `names` that is set wins (routes list their preferred name first)."""
    for name in names:
        value = get_int(body, name, None, lo=1)
        if value is not None:
            return value
    return None


def read_n(body: dict) -> None:
    n = get_int(body, "n", None)
    if n is not None and n != 1:
        raise bad_request(f"n must be 1 (one choice per request), not {n}.", "n")


def read_sampling(body: dict, max_token_names: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
                  ) -> SamplingFields:
    read_n(body)
    temperature = get_number(body, "temperature", 0.0, lo=0.0, hi=4.0)
    top_p = get_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = get_int(body, "top_k", 0, lo=0)
    min_p = get_number(body, "min_p", 0.0, lo=0.0, hi=1.0, hi_open=True)
    repetition_penalty = get_number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True)
    frequency_penalty = get_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
    presence_penalty = get_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
    seed = get_int(body, "seed", None)
    seed_given = seed is not None
    if seed is None:
        seed = secrets.randbits(63)
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed & SEED_MASK,
    )
    return SamplingFields(
        sampling=sampling,
        stops=read_stops(body),
        max_tokens=read_max_tokens(body, max_token_names),
        seed_given=seed_given,
    )


def new_id(prefix: str) -> str:
    """Response ids: chatcmpl-…, cmpl-…, call_…, msg_…, toolu_…, resp_… (24 hex chars)."""
    return prefix + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


def request_body(api: ApiContext, req: Any, family: str) -> Any:
    """A generating route's first steps: the family's not-ready error while the model
    loads, then the parsed JSON body (not yet checked), with the log line's session tag."""
    require_ready(api, family)
    body = req.json()
    session_tag(req, body if isinstance(body, dict) else {})
    return body


def session_tag(req: Any, body: dict) -> None:
    """Tag the request's log line with prompt_cache_key or X-Session-Id (never a key)."""
    tag = body.get("prompt_cache_key")
    if not isinstance(tag, str) or not tag:
        tag = req.headers.get("x-session-id") or req.headers.get("x-claude-code-session-id")
    if tag:
        try:
            req.session_tag = tag[:128]
        except AttributeError:
            pass
