"""The rollout server: the OpenAI wire format over the sampler's engine, on a local port.

Routes (also under `/sessions/<id>/v1/…`, a per-episode base URL):
- POST /v1/chat/completions: `messages` rendered with the tokenizer's chat template
  (`chat.render_prompt`, which also passes `tools` / `tool_choice`); `n`, `temperature`,
  `top_p`, `max_tokens` (or `max_completion_tokens`), `stop`, `seed`, `logprobs`; vLLM's
  `add_generation_prompt` (default true) and `continue_final_message` (default false: true
  continues the last, assistant, message instead of opening a new reply); `stream` answers the
  whole message as one server-sent event, then `[DONE]`.
- POST /v1/completions: `prompt` (text, or a list of token ids) with the same settings;
  `logprobs` (an integer) returns each token's log-prob (`top_logprobs` beyond the chosen token
  are not computed: any k > 0 is refused).
- GET /v1/models: the one model served (`model_name`).

Sessions (`sessions.Session`): a request belongs to the session named by its
`/sessions/<id>/v1` base URL, its `X-Session-Id` header, or its `user` field, in that order. A session records
its episode's exact tokens. An episode the trainer's collector runs draws as the in-process
episode of its (prompt, sample) would (`driver.EngineDriver.own_episode`: one key per episode,
its tokens numbered across turns); any other session is seeded by (seed, session, turn)
(`driver.request_key`).
A request without a session is served but not recorded; its `seed` field (default 0) seeds it.

Tool calls (`chat`, `tool_calls`): `tools`, `tool_choice`, assistant `tool_calls` and `role: "tool"`
messages are rendered in the model's syntax; a reply's tool-call markup comes back as the
message's `tool_calls` (finish_reason "tool_calls"), with ids from (session, turn, index). Calls
the model botched stay in the content and are counted in `Session.malformed_tool_calls`.

Log-probs reported: the model's own (unscaled) distribution, as `Completion.logprobs`. With
`exact` (`rollout.exact_logprobs`), every turn is verified and repaired before it is answered
(`exact_turns`): its tokens are canonical draws and its log-probs the canonical forward's.

HTTP: aiohttp's server on its own event loop in a thread (docs/agents.md says why aiohttp);
decoding happens on the engine driver's thread (`driver.EngineDriver`), so the event loop only
parses, renders and waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING

from reasoning_rl.agents import chat
from reasoning_rl.agents.driver import DecodeRequest, EngineDriver, request_key
from reasoning_rl.agents.exact_turns import ExactTurns
from reasoning_rl.agents.sessions import HistoryMismatch, Session, SessionBusy
from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler.sampling import SamplingParams

if TYPE_CHECKING:
  # aiohttp (0.25 s) is imported where a server starts and answers, not by every trainer process
  # that imports the agent collector
  from aiohttp import web


class BadRequest(ValueError):
  """A request the server answers with HTTP 400 and this message."""


_FINISH = {"stop_id": "stop", "stop_string": "stop", "length": "length"}


class RolloutServer:
  """Serves `driver`'s engine over HTTP (module docstring).

  tokenizer: renders chats, encodes prompts, decodes completions; its `eos_ids` end them.
  sampling: defaults a request's temperature / top_p override (top_k, min_p are the run's).
  max_tokens: a request's budget when it names none; `max_session_tokens`: the most tokens a
  session's segment may hold after its first prompt (the trainer's completion length), or 0;
  `max_segment_prompt`: the longest prompt a segment may start with (the trainer's prompt
  length), or 0.
  history_mismatch: `agent.history_mismatch` (split | refuse). tool_syntax: `agent.tool_syntax`
  ("" | hermes | llama3: the model's tool-call syntax when its template shows none).
  seed: the run's seed.
  exact: `exact_turns.ExactTurns` (`rollout.exact_logprobs`): every turn is verified and
  repaired before its reply is sent; None serves the drafts as they are.
  """

  def __init__(self, driver: EngineDriver, tokenizer, *, model_name: str = "policy",
               sampling: SamplingParams = SamplingParams(), max_tokens: int = 256,
               max_session_tokens: int = 0, max_segment_prompt: int = 0,
               history_mismatch: str = "split", tool_syntax: str = "", seed: int = 0,
               host: str = "127.0.0.1", port: int = 0, exact: ExactTurns | None = None):
    self.driver = driver
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.sampling = sampling
    self.max_tokens = max_tokens
    self.max_session_tokens = max_session_tokens
    self.max_segment_prompt = max_segment_prompt
    self.history_mismatch = history_mismatch
    self.tool_syntax = tool_syntax
    self.seed = seed
    self.exact = exact
    self._sessions: dict[str, Session] = {}
    self._lock = threading.Lock()
    self._loop = asyncio.new_event_loop()
    self._runner = None
    started = threading.Event()
    self._thread = threading.Thread(target=self._serve, args=(host, port, started),
                                    name="rollout-server", daemon=True)
    self._thread.start()
    started.wait()
    if self._runner is None:
      raise RuntimeError(f"the rollout server could not listen on {host}:{port}")

  # ------------------------------------------------------------------------------ sessions

  @property
  def url(self) -> str:
    """http://host:port (clients add /v1 or /sessions/<id>/v1)."""
    return f"http://{self._host}:{self._port}"

  def session_url(self, session_id: str) -> str:
    return f"{self.url}/sessions/{session_id}/v1"

  def session(self, session_id: str) -> Session:
    with self._lock:
      if session_id not in self._sessions:
        self._sessions[session_id] = Session(session_id, on_mismatch=self.history_mismatch,
                                             tokenizer=self.tokenizer)
      return self._sessions[session_id]

  def pop_session(self, session_id: str) -> Session | None:
    """The session's record, forgotten by the server (None if it never made a request)."""
    with self._lock:
      return self._sessions.pop(session_id, None)

  # ------------------------------------------------------------------------------ serving

  def _serve(self, host, port, started) -> None:
    from aiohttp import web  # see the TYPE_CHECKING import

    asyncio.set_event_loop(self._loop)
    app = web.Application()
    for prefix in ("/v1", "/sessions/{session}/v1"):
      app.router.add_get(prefix + "/models", self._models)
      app.router.add_post(prefix + "/chat/completions", self._chat)
      app.router.add_post(prefix + "/completions", self._completions)
    try:
      runner = web.AppRunner(app, access_log=None)
      self._loop.run_until_complete(runner.setup())
      site = web.TCPSite(runner, host, port)
      self._loop.run_until_complete(site.start())
      self._host, self._port = host, site._server.sockets[0].getsockname()[1]  # pylint: disable=protected-access
      self._runner = runner
    finally:
      started.set()
    self._loop.run_forever()
    self._loop.run_until_complete(runner.cleanup())
    self._loop.close()

  def stop(self) -> None:
    """Stops serving (the driver is its owner's to stop)."""
    if self._thread.is_alive():
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join()

  async def _models(self, request: web.Request) -> web.Response:
    from aiohttp import web

    del request
    return web.json_response({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": 0, "owned_by": "reasoning_rl"}]})

  async def _chat(self, request: web.Request) -> web.StreamResponse:
    return await self._answer(request, chat_request=True)

  async def _completions(self, request: web.Request) -> web.StreamResponse:
    return await self._answer(request, chat_request=False)

  async def _answer(self, request: web.Request, *, chat_request: bool) -> web.StreamResponse:
    from aiohttp import web

    try:
      body = await request.json()
      if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
      # the base URL's first: the trainer's per-episode URL wins over what an agent framework
      # may send on its own (a header, an end-user id in `user`)
      session_id = (request.match_info.get("session") or request.headers.get("X-Session-Id")
                    or body.get("user"))
      reply = await self._decode(body, session_id, chat_request=chat_request)
    except (BadRequest, HistoryMismatch, SessionBusy, SamplingError, json.JSONDecodeError) as error:
      return web.json_response({"error": {"message": str(error), "type": "invalid_request_error",
                                          "code": type(error).__name__}}, status=400)
    if body.get("stream"):
      return await _as_event_stream(request, reply, chat_request=chat_request)
    return web.json_response(reply)

  async def _decode(self, body: dict, session_id: str | None, *, chat_request: bool) -> dict:
    prompt, prompt_text = self._prompt_tokens(body, chat_request=chat_request)
    n = _integer(body, "n", 1, low=1)
    max_tokens = _integer(body, "max_completion_tokens",
                          _integer(body, "max_tokens", self.max_tokens, low=1), low=1)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", self.sampling.temperature, low=0.0),
        top_p=_number(body, "top_p", self.sampling.top_p, low=0.0, high=1.0),
        top_k=self.sampling.top_k, min_p=self.sampling.min_p)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) and s for s in stop):
      raise BadRequest(f"stop={body.get('stop')!r}: must be a string or a list of strings")
    want_logprobs = self._logprobs_wanted(body, chat_request=chat_request)
    session = None
    if session_id is not None:
      if n != 1:
        raise BadRequest(f"n={n}: a session's request draws one choice (its episode goes on "
                         "from it); send n > 1 without a session")
      session = self.session(str(session_id))
      # the session's tokens, which may tokenize the same text otherwise (sessions.py)
      prompt = session.begin_turn(prompt, text=prompt_text)
      segment = session.segments[-1]
      if self.max_segment_prompt and not segment.tokens and (
          len(segment.prompt_tokens) > self.max_segment_prompt):
        session.abandon_turn(drop_empty_segment=True)
        raise BadRequest(f"session {session.id!r}: a prompt of {len(prompt)} tokens starts a "
                         f"segment, longer than rollout.max_prefill_length="
                         f"{self.max_segment_prompt} (the trained row's prompt); raise it, or "
                         "shorten the conversation")
      if self.max_session_tokens:
        room = self.max_session_tokens - len(segment.tokens)
        if room < 1:
          session.abandon_turn()
          raise BadRequest(f"session {session.id!r}: its episode used its whole token budget "
                           f"({self.max_session_tokens}, rollout.max_new_tokens)")
        max_tokens = min(max_tokens, room)
      turn, seed = session.turns, self.seed
    else:
      turn, seed = 0, _integer(body, "seed", 0, low=0)
    requests = [DecodeRequest(
        prompt=prompt, key=request_key(seed, session_id, turn, choice), sampling=sampling,
        max_new_tokens=max_tokens, stop_ids=self.tokenizer.eos_ids, stop_strings=stop,
        session=session_id)
        for choice in range(n)]
    try:
      if self.exact is None:
        futures = [self.driver.submit(r) for r in requests]
        results = [await asyncio.wrap_future(f) for f in futures]
      else:
        results = await self._exact_results(requests, session_id)
    except BaseException:
      if session is not None:
        session.abandon_turn()
      raise
    texts = [self._text(r.tokens, r.finish_reason, stop) for r in results]
    if session is not None:
      r = results[0]
      session.end_turn(tokens=r.tokens, logprobs=r.logprobs,
                       sampling_logprobs=r.sampling_logprobs, versions=r.versions,
                       finish_reason=r.finish_reason, text=texts[0])
    reply_id = f"{'chatcmpl' if chat_request else 'cmpl'}-{uuid.uuid4().hex}"
    messages = None
    if chat_request:
      # tool call ids: (session, turn, index) in a session, so a rerun gives the same ids
      parsed = [chat.parse_assistant(
          self.tokenizer, text, tools=body.get("tools"), tool_choice=body.get("tool_choice"),
          session_id=session.id if session is not None else reply_id,
          turn=turn if session is not None else choice, tool_syntax=self.tool_syntax)
          for choice, text in enumerate(texts)]
      messages = [message for message, _ in parsed]
      if session is not None:
        session.malformed_tool_calls += parsed[0][1]
    return self._reply(reply_id, results, texts, messages, prompt, want_logprobs=want_logprobs)

  async def _exact_results(self, requests: list[DecodeRequest], session_id: str | None
                           ) -> list:
    """The requests' turns, verified (`exact_turns`): each seeded as the driver would seed it,
    and an owned episode's draws counted once the turn's tokens are settled."""
    seeded = []
    for request in requests:
      key, first_draw = self.driver.turn_seeding(request.session, request.key)
      seeded.append(dataclasses.replace(request, key=key, first_draw=first_draw))
    results = await asyncio.gather(*(self.exact.decode(r) for r in seeded))
    if session_id is not None:
      self.driver.count_draws(requests[0].session, len(results[0].tokens))
    return list(results)

  def _prompt_tokens(self, body: dict, *, chat_request: bool) -> tuple[list[int], str | None]:
    """The request's prompt: its tokens, and the text they encode (None for a token-id prompt)."""
    if chat_request:
      messages = body.get("messages")
      if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list of {role, content} objects")
      continue_final = _flag(body, "continue_final_message", False)
      try:
        text = chat.render_prompt(
            self.tokenizer, messages, tools=body.get("tools"), tool_choice=body.get("tool_choice"),
            add_generation_prompt=_flag(body, "add_generation_prompt", not continue_final),
            continue_final_message=continue_final, tool_syntax=self.tool_syntax)
      except ValueError as error:
        raise BadRequest(str(error)) from error
      return self.tokenizer.encode(text, add_special_tokens=False), text
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
      return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
      return list(prompt), None
    raise BadRequest("prompt: must be one non-empty string or one list of token ids")

  @staticmethod
  def _logprobs_wanted(body: dict, *, chat_request: bool) -> bool:
    if chat_request:
      if _integer(body, "top_logprobs", 0, low=0):
        raise BadRequest("top_logprobs: only the chosen token's log-prob is computed; send 0")
      return bool(body.get("logprobs"))
    value = body.get("logprobs")
    if value is None or value is False:
      return False
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise BadRequest(f"logprobs={value!r}: must be an integer >= 0")
    if value > 0:
      raise BadRequest("logprobs: only the chosen token's log-prob is computed (each in "
                       "token_logprobs); send logprobs=0")
    return True

  def _text(self, tokens: list[int], finish_reason: str, stop: list[str]) -> str:
    """A completion's text: a final stop id is not part of it, a stop string neither, nor what
    its last token holds after it (OpenAI's and vLLM's convention; the session keeps the tokens,
    so a client that continues the text writes the stop string back)."""
    if finish_reason == "stop_id":
      tokens = tokens[:-1]
    text = self.tokenizer.decode(tokens, skip_special_tokens=False)
    if finish_reason == "stop_string":
      found = [text.find(s) for s in stop if s in text]
      if found:
        text = text[:min(found)]
    return text

  def _reply(self, reply_id: str, results, texts, messages, prompt, *, want_logprobs: bool
             ) -> dict:
    """The response body; `messages` (the parsed assistant messages) for a chat request, else
    None."""
    chat_request = messages is not None
    choices = []
    for index, (r, text) in enumerate(zip(results, texts)):
      pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in r.tokens]
      if chat_request:
        message = messages[index]
        choice = {"index": index, "message": message,
                  "finish_reason": "tool_calls" if message.get("tool_calls")
                  else _FINISH[r.finish_reason], "logprobs": None}
        if want_logprobs:
          choice["logprobs"] = {"content": [
              {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
              for piece, lp in zip(pieces, r.logprobs)]}
      else:
        choice = {"index": index, "text": text, "finish_reason": _FINISH[r.finish_reason],
                  "logprobs": None}
        if want_logprobs:
          choice["logprobs"] = {"tokens": pieces, "token_logprobs": list(r.logprobs),
                                "top_logprobs": None, "text_offset": None}
      # what the trainer records, for clients that want to check it
      choice["token_ids"] = list(r.tokens)
      choices.append(choice)
    generated = sum(len(r.tokens) for r in results)
    return {"id": reply_id,
            "object": "chat.completion" if chat_request else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                      "total_tokens": len(prompt) + generated}}


async def _as_event_stream(request: web.Request, reply: dict, *, chat_request: bool
                           ) -> web.StreamResponse:
  """`reply` as server-sent events: one chunk per choice holding its whole text, then [DONE]."""
  from aiohttp import web

  response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
  await response.prepare(request)
  for choice in reply["choices"]:
    if chat_request:
      delta = dict(choice["message"])
      if delta.get("tool_calls"):  # a streamed call names its place in the list
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
      part = {"index": choice["index"], "delta": delta,
              "finish_reason": choice["finish_reason"], "logprobs": choice["logprobs"]}
    else:
      part = dict(choice)
    chunk = {"id": reply["id"], "created": reply["created"], "model": reply["model"],
             "object": "chat.completion.chunk" if chat_request else "text_completion",
             "choices": [part]}
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
  await response.write(b"data: [DONE]\n\n")
  await response.write_eof()
  return response


def _integer(body: dict, name: str, default: int, *, low: int) -> int:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise BadRequest(f"{name}={value!r}: must be an integer >= {low}")
  return value


def _flag(body: dict, name: str, default: bool) -> bool:
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise BadRequest(f"{name}={value!r}: must be true or false")
  return value


def _number(body: dict, name: str, default: float, *, low: float, high: float | None = None
            ) -> float:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (
      high is not None and value > high):
    raise BadRequest(f"{name}={value!r}: must be a number in [{low}, {high or 'inf'}]")
  return float(value)


__all__ = ["BadRequest", "RolloutServer"]
