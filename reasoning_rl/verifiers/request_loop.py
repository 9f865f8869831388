"""The loop a verifier worker process runs: the VerifierPool's workers and the deadline helpers.

Both say "ready" once their start-up (imports, unpickling) is done, so start-up is never charged to
a request's time limit, then answer one request at a time until the parent closes the connection.
A reply that cannot be pickled is replaced by `unsendable(request, error)`: nothing reached the
pipe yet, so the connection stays usable and the parent still gets exactly one reply.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any, Callable


def answer_requests(conn: Connection, ready: Any, answer: Callable[[Any], Any],
                    unsendable: Callable[[Any, Exception], Any]) -> None:
  """Sends `ready`, then `answer(request)` for every request received, until EOF."""
  conn.send(ready)
  while True:
    try:
      request = conn.recv()
    except (EOFError, OSError):
      return
    reply = answer(request)
    try:
      conn.send(reply)
    except Exception as error:  # PicklingError, TypeError, … of an unpicklable value
      conn.send(unsendable(request, error))
