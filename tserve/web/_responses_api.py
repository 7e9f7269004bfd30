"""``/v1/responses``: OpenAI's Responses API, its stored responses and background runs.

A thin mapping on the chat machinery: the body becomes a :class:`ChatRequest`
(:mod:`._response_requests`, after the stored conversation of
``previous_response_id``), :meth:`Generation.run_chat` runs it exactly as it
runs a chat completion (admission, tools and their grammar, abort on
hang-up, the drain, metrics), and a :class:`ResponseOutput`
(:mod:`._response_events`) shapes the answer. The store is
:mod:`._response_store`'s (shared by every API process).

Routes::

    POST   /v1/responses                   create (JSON, SSE, or background)
    GET    /v1/responses/{id}              the stored response
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items  its input items, paged
    POST   /v1/responses/{id}/cancel       cancel a background response

Background responses (``background: true``, which needs ``store``): the
POST answers at once with status "queued"; the generation runs in a task of
the server's nursery (:meth:`Responses.run`), not the request's, and writes
the record as it goes ("in_progress", then "completed", "incomplete",
"failed" or "cancelled"). A cancel aborts the engine request as a client
hang-up does: at once in the owning process, through a marker file from
another one (:data:`CANCEL_POLL`). A background run counts as in flight for
the drain (it runs under :meth:`InFlight.abortable`); what still runs past
the drain ends "failed", and a run cancelled from outside (the server's
nursery) "cancelled".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import trio
from quart import Response, request

from tserve.nursery import InvalidRequest, ShuttingDown
from tserve.web._errors import NotFound, error_reply
from tserve.web._generation import Generation
from tserve.web._metrics import RequestRecord
from tserve.web._model_lookup import ServedModel
from tserve.web._response_events import ResponseOutput, new_response_id
from tserve.web._response_requests import ResponseRequest, parse_responses
from tserve.web._response_store import CANCEL_POLL, ResponseStore, StoredResponse
from tserve.web._routing import json_response, read_body
from tserve.web._tools import ToolPlan

__all__ = ["Responses"]

log = logging.getLogger("tserve.web")

JSON = dict[str, Any]

MAX_LIST = 100  # input_items' largest page
_CANCEL_WAIT = 30.0  # seconds a cancel from another process waits for the owner to record it
_TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclasses.dataclass(slots=True)
class _Running:
    """A background response this process runs."""

    scope: trio.CancelScope
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


_ResponseFactory = Callable[[str, ToolPlan | None, int, ServedModel], ResponseOutput]
"""One response's output for ``Generation.run_chat`` (its OutputFactory)."""


class Responses:
    """The Responses handlers of one app, over its :class:`Generation` and the store."""

    def __init__(
        self,
        generation: Generation,
        store: ResponseStore,
        new_record: Callable[[str], RequestRecord],
    ) -> None:
        self._generation = generation
        self.store = store
        self._new_record = new_record  # a metrics record for a background run
        self._nursery: trio.Nursery | None = None
        self._running: dict[str, _Running] = {}  # background responses of this process

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the background runs and the store's sweeps until cancelled (the server's
        life). Blocks. A sweep runs in a worker thread, one at a time; sweeps asked for
        meanwhile are one more."""
        due = trio.Event()

        def sweep_due() -> None:
            due.set()

        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.store.on_sweep_due = sweep_due
                task_status.started()
                while True:
                    await due.wait()
                    due = trio.Event()
                    await trio.to_thread.run_sync(self.store.sweep, abandon_on_cancel=True)
        finally:
            self.store.on_sweep_due = None
            self._nursery = None
            self.store.close()

    # -- create ----------------------------------------------------------------------

    async def create(self, record: RequestRecord) -> Response:
        req = parse_responses(await read_body())
        if req.background and req.stream:
            raise InvalidRequest(
                "'stream' with 'background' is not supported by this server: poll the "
                "background response with GET /v1/responses/{id}",
                param="stream",
            )
        history = self._history(req)
        chat = req.chat(history)
        response_id = new_response_id()
        conversation = [*history, *req.items]
        outputs: list[ResponseOutput] = []

        def output(
            model: str, plan: ToolPlan | None, count: int, served: ServedModel
        ) -> ResponseOutput:
            assert count == 1, "a response runs one stream"
            on_end = None
            if req.store:
                on_end = lambda obj: self._put(obj, conversation)  # noqa: E731
            outputs.append(
                ResponseOutput(
                    model,
                    plan,
                    response_id=response_id,
                    echo=req.echo,
                    on_end=on_end,
                    namespaces=req.namespaces,
                    reasoning=served.reasoning_for(chat.template_kwargs),
                )
            )
            return outputs[0]

        if req.background:
            return self._start_background(req, chat, response_id, conversation, output)
        try:
            return await self._generation.run_chat(record, chat, output)
        except InvalidRequest as exc:
            raise _renamed(exc, req) from None

    def _history(self, req: ResponseRequest) -> list[JSON]:
        if req.previous_response_id is None:
            return []
        stored = self.store.get(req.previous_response_id)
        if stored is None:
            raise NotFound(
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
            )
        if stored.response["status"] in ("queued", "in_progress"):
            raise InvalidRequest(
                f"Previous response with id '{req.previous_response_id}' is still "
                f"{stored.response['status']}: wait for it to finish",
                param="previous_response_id",
            )
        return [*stored.input_items, *stored.response["output"]]

    def _put(self, response: JSON, conversation: list[JSON]) -> None:
        self.store.put(StoredResponse(response=response, input_items=conversation))

    # -- background --------------------------------------------------------------------

    def _start_background(
        self,
        req: ResponseRequest,
        chat: Any,
        response_id: str,
        conversation: list[JSON],
        output: _ResponseFactory,
    ) -> Response:
        if self._nursery is None:
            raise ShuttingDown("background responses are not running")
        model = self._generation.resolve_model(chat.model)
        queued = ResponseOutput(model, None, response_id=response_id, echo=req.echo)
        self._put(queued.obj("queued"), conversation)
        running = _Running(trio.CancelScope())
        self._running[response_id] = running
        self._nursery.start_soon(self._background, req, chat, queued, conversation, output, running)
        return json_response(queued.obj("queued"))

    async def _background(
        self,
        req: ResponseRequest,
        chat: Any,
        queued: ResponseOutput,
        conversation: list[JSON],
        output: _ResponseFactory,
        running: _Running,
    ) -> None:
        """One background response, from "in_progress" to its end, recorded at each step."""
        response_id = queued.id
        record = self._new_record(response_id)
        made: list[ResponseOutput] = []

        def tracked(
            model: str, plan: ToolPlan | None, count: int, served: ServedModel
        ) -> ResponseOutput:
            made.append(output(model, plan, count, served))
            return made[-1]

        status = 499
        failure: Exception | None = None
        try:
            with running.scope:
                async with trio.open_nursery() as watch:
                    watch.start_soon(self._watch_cancel, response_id, running.scope)
                    self._put(queued.obj("in_progress"), conversation)
                    try:
                        reply = await self._generation.run_chat(record, chat, tracked)
                        status = reply.status_code
                    except Exception as exc:  # raised below: the nursery would wrap it
                        failure = _renamed(exc, req) if isinstance(exc, InvalidRequest) else exc
                    finally:
                        watch.cancel_scope.cancel()
            if failure is not None:
                raise failure
        except Exception as exc:
            reply_ = error_reply(exc, record.request_id)
            status = reply_.status
            failed = (made[0] if made else queued).obj(
                "failed",
                error={"code": "server_error", "message": str(reply_.body["error"]["message"])},
            )
            self._put(failed, conversation)
        finally:
            record.done(status)
            if running.scope.cancelled_caught or status == 499:
                self._put((made[0] if made else queued).obj("cancelled"), conversation)
            del self._running[response_id]
            running.done.set()

    async def _watch_cancel(self, response_id: str, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` once another process leaves the cancel marker. Blocks."""
        # A file another process writes: no event to wait on, so a poll.
        while not self.store.cancel_requested(response_id):  # noqa: ASYNC110
            await trio.sleep(CANCEL_POLL)
        scope.cancel()

    async def cancel(self, record: RequestRecord, response_id: str) -> Response:
        stored = self._stored(response_id)
        if not stored.response.get("background"):
            raise InvalidRequest(
                "Only responses created with background=true can be cancelled",
                param="response_id",
            )
        if stored.response["status"] in _TERMINAL:
            return json_response(stored.response)
        running = self._running.get(response_id)
        if running is not None:
            running.scope.cancel()
            await running.done.wait()
        else:  # another process runs it
            self.store.request_cancel(response_id)
            with trio.move_on_after(_CANCEL_WAIT):
                while stored.response["status"] not in _TERMINAL:
                    await trio.sleep(CANCEL_POLL)
                    stored = self._stored(response_id)
        return json_response(self._stored(response_id).response)

    # -- the stored responses --------------------------------------------------------

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return stored

    async def retrieve(self, record: RequestRecord, response_id: str) -> Response:
        return json_response(self._stored(response_id).response)

    async def delete(self, record: RequestRecord, response_id: str) -> Response:
        running = self._running.get(response_id)
        if running is not None:
            running.scope.cancel()
            await running.done.wait()
        if not self.store.delete(response_id):
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, record: RequestRecord, response_id: str) -> Response:
        items = self._stored(response_id).input_items
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("'order' must be asc or desc", param="order")
        limit = _limit(request.args.get("limit"))
        if order == "desc":
            items = items[::-1]
        after = request.args.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequest(f"'after': no item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {MAX_LIST}", param="limit")
    return limit


def _renamed(exc: InvalidRequest, req: ResponseRequest) -> InvalidRequest:
    """A problem the chat machinery named by its own field, named by this API's."""
    message = str(exc).replace("max_tokens", "max_output_tokens")
    if exc.param in ("prompt", "messages"):
        if req.previous_response_id is not None:
            return InvalidRequest(
                f"The conversation of 'previous_response_id' and this input is too long or "
                f"malformed: {message}",
                param="previous_response_id",
            )
        return InvalidRequest(message, param="input")
    if exc.param == "max_tokens":
        return InvalidRequest(message, param="max_output_tokens")
    return exc
