"""An OpenAI-compatible HTTP gateway in front of a rollout engine, for agents written against the ``openai`` client.

Each agent trajectory is a session, named in the base URL (``http://HOST:PORT/sessions/{id}/v1``, so that an
unmodified client only needs a ``base_url``) or in an ``X-Session-Id`` header. ``/v1/completions`` and
``/v1/chat/completions`` (tools, stop, temperature, top_p, seed, max_tokens, logprobs) run the engine on token ids
that the gateway keeps per session (``rlmega.gateway.sessions``): a call that extends the session's conversation is
the previous context's ids plus the tokens of what is new, so the trajectory holds exactly what the engine read and
wrote. ``POST /v1/sessions/{id}/reward`` records the harness's reward, ``GET /v1/sessions/{id}`` the trajectory.

Bound to 127.0.0.1 by default; bound elsewhere it needs a bearer token. Requests are bounded in size, engine calls in
time; a bad request gets a 4xx with OpenAI's error shape and one plain sentence.
"""

import asyncio
import functools
import ipaddress
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from rlmega.agent.parsers import Parser, as_tool_call, hermes_parser
from rlmega.agent.template import ChatTokens
from rlmega.errors import UserError
from rlmega.gateway.sessions import Segment, Session, SessionStore
from rlmega.rollout.protocol import Generation, SamplingParams

MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 256


class RequestError(ValueError):
    """A request the gateway refuses: HTTP ``status`` and one plain sentence."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _normalized(message: dict) -> tuple:
    """A chat message as far as the conversation goes: what a client echoes back may add fields or spell
    ``content`` None for an empty string."""
    calls = tuple((call.get("id"), call.get("function", {}).get("name"),
                   json.dumps(json.loads(call.get("function", {}).get("arguments") or "{}"), sort_keys=True))
                  for call in message.get("tool_calls") or ())
    return message.get("role"), message.get("content") or "", calls, message.get("tool_call_id")


def _sampling(body: dict, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: a session is one trajectory; start n sessions for a group")
    try:
        return SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                              max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens")
                                                 or DEFAULT_MAX_TOKENS),
                              stop_token_ids=stop_token_ids, seed=body.get("seed"))
    except (TypeError, ValueError) as error:
        raise RequestError(str(error)) from None


class Gateway:
    """The gateway over ``generate(prompts, params) -> list[Generation]`` (an engine's or the trainer's generator)
    and the policy's ``tokenizer``. ``serve()`` starts it on a thread; ``url``; ``close()``."""

    def __init__(self, generate: Callable[[list[list[int]], SamplingParams], list[Generation]], tokenizer: Any, *,
                 host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES, timeout_s: float = 300.0,
                 stop_token_ids: Optional[tuple[int, ...]] = None, store: Optional[SessionStore] = None,
                 parser: Parser = hermes_parser,
                 params_for: Optional[Callable[[str, SamplingParams], SamplingParams]] = None,
                 session_generate: Optional[Callable[[str, list[int], SamplingParams], Generation]] = None,
                 max_concurrent_calls: int = 16):
        """``parser``: how a reply's tool calls are read (``hermes``, or ``agent.parser``'s kind of function);
        ``params_for(session_id, asked)``: the sampling parameters a call runs with (a training run's own),
        instead of the ones the harness asked for; ``session_generate(session_id, prompt_ids, params)``: one
        session's engine call, instead of ``generate`` (a training run serves its sessions' calls as its rollout
        mode says); ``max_concurrent_calls``: calls served at once (each holds a thread while the engine works, so
        this bounds how many calls reach the engines together)."""
        self.check_binding(host, token)
        self.generate, self.tokenizer = generate, tokenizer
        self.session_generate = session_generate
        self.parser, self.params_for = parser, params_for
        self.max_concurrent_calls = max_concurrent_calls
        self._executor: Optional[ThreadPoolExecutor] = None
        self.host, self.port, self.token = host, port, token
        self.max_request_bytes, self.timeout_s = max_request_bytes, timeout_s
        self.stop_token_ids = tuple(stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id])
        self.sessions = store or SessionStore()
        self._locks: dict[str, threading.Lock] = {}
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self.app = self._make_app()

    @staticmethod
    def check_binding(host: str, token: Optional[str]) -> None:
        """Refuse an address other machines reach without a bearer token."""
        if not ipaddress.ip_address(host).is_loopback and not token:
            raise UserError(f"the gateway on {host} lets other machines call the engine: give it a token (a bearer "
                            "token the harness sends: gateway.token, --token), or bind to 127.0.0.1")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        """The ``base_url`` an ``openai`` client of this session uses."""
        return f"{self.url}/sessions/{session_id}/v1"

    # ---- the calls ------------------------------------------------------------------------------------------------

    def complete(self, session_id: str, body: dict) -> dict:
        """``/v1/completions`` for a session: the prompt continues the session's text, or starts a segment."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be one string (one trajectory per session)")
        params = self._params(session_id, body)
        with self._lock(session_id):
            session = self.sessions.get(session_id)
            segment = session.segments[-1] if session.segments else None
            if segment is not None and segment.messages is None and prompt.startswith(segment.context_text):
                new_ids = self._encode(prompt[len(segment.context_text):])
            else:
                segment, new_ids = self._new_segment(session, self._encode(prompt)), []
            generation = self._generate(session_id, segment.context_ids + new_ids, params)
            text = self._text(generation)
            segment.add_turn(new_ids, generation)
            segment.context_text = prompt + text
            self._called(session)
        choice = {"index": 0, "text": text, "finish_reason": generation.finish_reason,
                  "logprobs": self._completion_logprobs(generation) if body.get("logprobs") else None}
        return self._response("text_completion", body, [choice], segment, generation)

    def chat(self, session_id: str, body: dict) -> dict:
        """``/v1/chat/completions`` for a session: messages that extend the session's conversation append only what
        is new (tool results, user turns, the template's glue), rendered by the chat template with ``tools``."""
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of message objects")
        params = self._params(session_id, body)
        chat = ChatTokens(self.tokenizer, tools=tools, stop_token_ids=self.stop_token_ids)
        with self._lock(session_id):
            session = self.sessions.get(session_id)
            segment = session.segments[-1] if session.segments else None
            known = segment.messages if segment is not None else None
            if known and len(messages) > len(known) and \
                    [_normalized(m) for m in messages[:len(known)]] == [_normalized(m) for m in known]:
                new_ids = chat.glue_ids(known, messages[len(known):])
            else:
                segment, new_ids = self._new_segment(session, chat.prompt_ids(messages)), []
            generation = self._generate(session_id, segment.context_ids + new_ids, params)
            message = self._assistant_message(self._text(generation), generation)
            segment.add_turn(new_ids, generation)
            segment.messages = [*messages, message]
            self._called(session)
        finish = "tool_calls" if message.get("tool_calls") else generation.finish_reason
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": self._chat_logprobs(generation)} if body.get("logprobs") else None}
        return self._response("chat.completion", body, [choice], segment, generation)

    def set_reward(self, session_id: str, body: dict) -> dict:
        session = self.sessions.find(session_id)
        if session is None:
            raise RequestError(f"no session {session_id!r}", 404)
        try:
            session.reward = float(body["reward"])
        except (KeyError, TypeError, ValueError):
            raise RequestError('the body must be {"reward": <number>}') from None
        return {"id": session_id, "reward": session.reward}

    # ---- helpers --------------------------------------------------------------------------------------------------

    def _new_segment(self, session: Session, prompt_ids: list[int]) -> Segment:
        """A call that does not extend the session's context starts a segment (counted after the first)."""
        self.sessions.count_new_segment(session)
        session.segments.append(Segment(prompt_ids))
        return session.segments[-1]

    def _params(self, session_id: str, body: dict) -> SamplingParams:
        asked = _sampling(body, self.stop_token_ids)
        return asked if self.params_for is None else self.params_for(session_id, asked)

    def _lock(self, session_id: str) -> threading.Lock:
        return self._locks.setdefault(session_id, threading.Lock())

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.session_generate is not None:
            return self.session_generate(session_id, prompt_ids, params)
        return self.generate([prompt_ids], params)[0]

    def _text(self, generation: Generation) -> str:
        """The reply as the harness sees it: the final stop token is the engine's, not the text's."""
        ids = generation.response_token_ids
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _assistant_message(self, text: str, generation: Generation) -> dict:
        calls = [call for call in map(as_tool_call, self.parser(text)) if call.error is None]
        message: dict = {"role": "assistant", "content": text}
        if calls:
            if self.parser is hermes_parser:  # the text around the calls is the reply's content
                message["content"] = text[:text.find("<tool_call>")].strip() or None
            message["tool_calls"] = [
                {"id": f"call_{secrets.token_hex(6)}", "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments)}} for call in calls]
        return message

    def _completion_logprobs(self, generation: Generation) -> dict:
        tokens = [self.tokenizer.decode([token]) for token in generation.response_token_ids]
        return {"tokens": tokens, "token_logprobs": list(generation.logprobs), "top_logprobs": None,
                "text_offset": None}

    def _chat_logprobs(self, generation: Generation) -> list[dict]:
        return [{"token": self.tokenizer.decode([token]), "logprob": logprob, "bytes": None, "top_logprobs": []}
                for token, logprob in zip(generation.response_token_ids, generation.logprobs)]

    def _response(self, kind: str, body: dict, choices: list, segment: Segment, generation: Generation) -> dict:
        return {"id": f"rlmega-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()),
                "model": body.get("model", "policy"), "choices": choices,
                "usage": {"prompt_tokens": len(segment.context_ids) - len(generation.response_token_ids),
                          "completion_tokens": len(generation.response_token_ids),
                          "total_tokens": len(segment.context_ids)},
                "weight_version": generation.weight_version}

    @staticmethod
    def _called(session: Session) -> None:
        session.calls += 1
        session.last_call = time.monotonic()

    # ---- HTTP -----------------------------------------------------------------------------------------------------

    def _make_app(self):
        # The handlers' annotations are read by FastAPI at runtime (this module keeps them unpostponed).
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="rlmega gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def error(message: str, status: int) -> JSONResponse:
            kind = "authentication_error" if status == 401 else "invalid_request_error"
            return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

        async def handle(request: Request, call: Callable[[str, dict], dict], session_id: Optional[str]):
            if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
                return error("a bearer token is required (Authorization: Bearer <gateway.token>)", 401)
            if int(request.headers.get("content-length") or 0) > self.max_request_bytes:
                return error(f"the request is larger than {self.max_request_bytes} bytes", 413)
            raw = await request.body()
            if len(raw) > self.max_request_bytes:
                return error(f"the request is larger than {self.max_request_bytes} bytes", 413)
            session_id = session_id or request.headers.get("x-session-id")
            if not session_id:
                return error("no session: use base_url .../sessions/<id>/v1 or an X-Session-Id header", 400)
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                # A dedicated pool: asyncio's default one has a few threads per core, fewer than the sessions.
                served = asyncio.get_running_loop().run_in_executor(self._executor,
                                                                    functools.partial(call, session_id, body))
                return await asyncio.wait_for(served, self.timeout_s)
            except json.JSONDecodeError:
                return error("the body is not valid JSON", 400)
            except RequestError as refused:
                return error(str(refused), refused.status)
            except asyncio.TimeoutError:
                return error(f"the engine did not answer within {self.timeout_s:g} s", 504)
            except OverflowError as full:
                return error(str(full), 503)
            except KeyError as closed:
                return error(closed.args[0], 404)

        for prefix in ("/v1", "/sessions/{session_id}/v1"):
            @app.post(prefix + "/completions")
            async def completions(request: Request, session_id: Optional[str] = None):
                return await handle(request, self.complete, session_id)

            @app.post(prefix + "/chat/completions")
            async def chat_completions(request: Request, session_id: Optional[str] = None):
                return await handle(request, self.chat, session_id)

        @app.post("/v1/sessions/{session_id}/reward")
        async def reward(request: Request, session_id: str):
            return await handle(request, self.set_reward, session_id)

        @app.get("/v1/sessions/{session_id}")
        async def trajectory(request: Request, session_id: str):
            if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
                return error("a bearer token is required (Authorization: Bearer <gateway.token>)", 401)
            session = self.sessions.find(session_id)
            return error(f"no session {session_id!r}", 404) if session is None else session.as_dict()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rlmega"}]}

        return app

    def serve(self, timeout_s: float = 60.0) -> "Gateway":
        """Start serving on a thread; returns once the server listens (its port chosen when ``port`` is 0)."""
        import uvicorn

        self._executor = ThreadPoolExecutor(self.max_concurrent_calls, thread_name_prefix="rlmega-gateway-call")
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="rlmega-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
