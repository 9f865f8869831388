"""A tiny deterministic OpenAI-compatible chat server for tests (aiohttp, on a thread).

It answers `POST <prefix>/chat/completions` with scripted replies and `GET <prefix>/models`, and
records every request it got, so a test can count the model calls an agent made and check where
they went. Nothing is sampled: the reply is a function of the request.

    with FakeOpenAIServer(reply=lambda body: "42") as server:
      client = openai.AsyncOpenAI(base_url=server.base_url, api_key="test-key")
      ...
      assert len(server.chat_requests) == 1

`reply`: a callable (the request's JSON body -> the reply text), or a list of texts served in
order (one per chat request; running out is an HTTP 500 the test will see).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
  """One request the server got: method, path, headers (lower-cased names) and JSON body."""

  method: str
  path: str
  headers: dict[str, str]
  body: Any


class FakeOpenAIServer:
  """OpenAI-compatible chat server on 127.0.0.1 (a free port), run on its own thread."""

  def __init__(self, reply: Callable[[dict], str] | Sequence[str], *, prefix: str = "/v1",
               model: str = "fake-model"):
    self._reply = reply if callable(reply) else list(reply).__iter__()
    self.prefix = prefix.rstrip("/")
    self.model = model
    self.requests: list[RecordedRequest] = []
    self._lock = threading.Lock()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._runner: web.AppRunner | None = None
    self._thread: threading.Thread | None = None
    self._started = threading.Event()
    self._failure: BaseException | None = None
    self.port: int | None = None

  @property
  def base_url(self) -> str:
    """What an OpenAI client takes as base_url (ends in the prefix, e.g. /v1)."""
    return f"http://127.0.0.1:{self.port}{self.prefix}"

  @property
  def chat_requests(self) -> list[RecordedRequest]:
    with self._lock:
      return [r for r in self.requests if r.path.endswith("/chat/completions")]

  def _next_reply(self, body: dict) -> str:
    if callable(self._reply):
      return self._reply(body)
    with self._lock:
      return next(self._reply)

  async def _chat(self, request: web.Request) -> web.Response:
    body = await request.json()
    self._record(request, body)
    try:
      text = self._next_reply(body)
    except StopIteration:
      return web.json_response({"error": {"message": "no scripted reply left"}}, status=500)
    prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
    completion_tokens = len(text.split())
    return web.json_response({
        "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion",
        "created": int(time.time()), "model": body.get("model", self.model),
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}})

  async def _models(self, request: web.Request) -> web.Response:
    self._record(request, None)
    return web.json_response({"object": "list", "data": [
        {"id": self.model, "object": "model", "created": 0, "owned_by": "test"}]})

  async def _anything_else(self, request: web.Request) -> web.Response:
    # Recorded too, so a test sees a call to a route this server does not serve.
    self._record(request, await request.text())
    return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)

  def _record(self, request: web.Request, body: Any) -> None:
    with self._lock:
      self.requests.append(RecordedRequest(request.method, request.path,
                                           {k.lower(): v for k, v in request.headers.items()},
                                           body))

  def _serve(self) -> None:
    loop = asyncio.new_event_loop()
    self._loop = loop
    try:
      app = web.Application()
      app.router.add_post(f"{self.prefix}/chat/completions", self._chat)
      app.router.add_get(f"{self.prefix}/models", self._models)
      app.router.add_route("*", "/{tail:.*}", self._anything_else)
      self._runner = web.AppRunner(app)
      loop.run_until_complete(self._runner.setup())
      site = web.TCPSite(self._runner, "127.0.0.1", 0)
      loop.run_until_complete(site.start())
      self.port = site._server.sockets[0].getsockname()[1]
    except BaseException as e:  # reported to start(), which re-raises it on the test's thread
      self._failure = e
      self._started.set()
      loop.close()
      return
    self._started.set()
    loop.run_forever()
    loop.run_until_complete(self._runner.cleanup())
    loop.close()

  def start(self) -> FakeOpenAIServer:
    self._thread = threading.Thread(target=self._serve, name="fake-openai", daemon=True)
    self._thread.start()
    self._started.wait(timeout=30)
    if self._failure is not None:
      raise RuntimeError("the fake OpenAI server did not start") from self._failure
    return self

  def stop(self) -> None:
    if self._loop is not None and self._thread is not None and self._thread.is_alive():
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=30)

  def __enter__(self) -> FakeOpenAIServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
