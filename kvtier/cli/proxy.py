"""A small OpenAI-compatible proxy for prefill/decode disaggregation through the pool.

Each completion or chat request goes first to a prefill instance (kvtier
``kv_producer``) with ``max_tokens=1`` and one sequence (``n=1``, no ``best_of``),
which returns once the prompt's blocks are durable in the pool, then to a decode
instance (``kv_consumer``), which loads them; the decode instance's answer (streamed or
not) is returned. The request reaches decode unchanged but for prefill's
``kv_transfer_params``: where prefill was still storing blocks when it answered (its
host pool full), they say how many prompt tokens, and decode waits for them
(``kvtier.scheduler.handoffs``). Instances are used round-robin.
``kvtier proxy --prefill URL --decode URL``.

What a client sees when something fails:
- the client's own headers (``Authorization`` above all) reach both instances;
- a body that is not a JSON object: 400, with an OpenAI-style error;
- the prefill instance unreachable or failing (5xx): the request still goes to
  decode, which computes the prompt itself (slower, but answered), and it is logged;
  a 4xx from prefill (a bad request, a wrong API key) is returned as it is;
- the decode instance unreachable: 502, with an OpenAI-style error;
- decode dying in the middle of a stream, or its stream ending without ``[DONE]``
  however it ends: the stream ends with an error event (``data: {"error": ...}``) and
  no ``[DONE]``, never with a silent truncation.
No limit on connections to the instances (a few hung decodes never queue the
others), and request bodies up to ``max_body_bytes``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

logger = logging.getLogger("kvtier.cli.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
_DONE = b"data: [DONE]"
# Hop-by-hop and per-connection headers are the proxy's own; every other one is the client's.
_NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                  "proxy-authorization", "proxy-connection", "te", "trailer", "accept-encoding"}


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _events_end(data: bytes) -> int:
    """Where the last whole server-sent event in ``data`` ends (0: none is whole yet)."""
    ends = [at + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (at := data.rfind(sep)) >= 0]
    return max(ends, default=0)


def _prefill_body(body: dict) -> dict:
    """One sequence, one token, no stream: prefill's answer is only waited for, never used."""
    prefill = {**body, "max_tokens": 1, "stream": False, "n": 1}
    for key in ("max_completion_tokens", "stream_options", "best_of"):
        prefill.pop(key, None)
    return prefill


def _with_handoff(body: dict, prefill_answer: bytes) -> dict:
    """The decode request, with the ``kv_transfer_params`` of prefill's answer (the prompt tokens it is
    still storing, which decode waits for), unless the client sent its own."""
    try:
        params = json.loads(prefill_answer).get("kv_transfer_params")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return body
    if not isinstance(params, dict) or "kv_transfer_params" in body:
        return body
    return {**body, "kv_transfer_params": params}


def make_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600,
             max_body_bytes: int = 64 << 20) -> web.Application:
    prefill_cycle, decode_cycle = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    app = web.Application(client_max_size=max_body_bytes)

    async def session(app_: web.Application):
        app_["session"] = ClientSession(timeout=ClientTimeout(total=timeout_s), connector=TCPConnector(limit=0))
        yield
        await app_["session"].close()

    app.cleanup_ctx.append(session)

    async def forward(request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as error:
            return _error(400, f"the request body is not JSON: {error}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        http = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        prefill_url = next(prefill_cycle)
        decode_body = body
        try:
            async with http.post(prefill_url + request.path, json=_prefill_body(body), headers=headers) as prefill:
                answer = await prefill.read()
                if 400 <= prefill.status < 500:  # the request itself is refused: say so, do not decode
                    return web.Response(status=prefill.status, body=answer, content_type=prefill.content_type)
                if prefill.status != 200:
                    logger.warning("kvtier proxy: prefill %s answered %d; decode computes the prompt itself",
                                   prefill_url, prefill.status)
                else:
                    decode_body = _with_handoff(body, answer)
        except (ClientError, TimeoutError) as error:
            logger.warning("kvtier proxy: prefill %s failed (%r); decode computes the prompt itself",
                           prefill_url, error)
        decode_url = next(decode_cycle)
        response = None
        try:
            async with http.post(decode_url + request.path, json=decode_body, headers=headers) as decode:
                if not body.get("stream") or decode.status != 200:
                    return web.Response(status=decode.status, body=await decode.read(),
                                        content_type=decode.content_type)
                response = web.StreamResponse(status=200, headers={"Content-Type": decode.content_type})
                await response.prepare(request)
                # Whole events only: one cut short must not run into the error event that follows it.
                pending = last = b""
                async for chunk in decode.content.iter_any():
                    pending += chunk
                    end = _events_end(pending)
                    if end:
                        await response.write(pending[:end])
                        last, pending = pending[:end], pending[end:]
                if not pending.strip() and last.rstrip().endswith(_DONE):  # an OpenAI stream ends so, or is cut
                    await response.write_eof()
                    return response
                error = ConnectionError("the stream ended without [DONE]")
        except (ClientError, TimeoutError, ConnectionError) as failure:
            error = failure
        except Exception as failure:  # headers out or not, the client is told, never cut off silently
            logger.exception("kvtier proxy: relaying decode %s's answer failed", decode_url)
            error = failure
        if response is not None and (request.transport is None or request.transport.is_closing()):
            logger.info("kvtier proxy: the client left during decode %s's answer", decode_url)
            return response
        logger.warning("kvtier proxy: decode %s failed (%r)", decode_url, error)
        message = f"the decode instance failed: {error!r}"
        if response is None:
            return _error(502, message, "upstream_error")
        # Headers are out: the failure is told in the stream, and it ends without [DONE].
        event = {"error": {"message": message, "type": "upstream_error", "code": 502}}
        with contextlib.suppress(ConnectionError):  # the client may leave at any time
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        try:
            async with request.app["session"].get(decode_urls[0] + "/v1/models", headers=headers) as reply:
                return web.Response(status=reply.status, body=await reply.read(), content_type=reply.content_type)
        except (ClientError, TimeoutError) as error:
            return _error(502, f"the decode instance failed: {error!r}", "upstream_error")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    for route in ROUTES:
        app.router.add_post(route, forward)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def serve(prefill_urls: list[str], decode_urls: list[str], host: str, port: int) -> None:
    print(f"kvtier proxy on http://{host}:{port}: prefill {prefill_urls}, decode {decode_urls}", flush=True)
    # SIGTERM: requests in flight get 10 s to finish, then the proxy exits regardless.
    web.run_app(make_app(prefill_urls, decode_urls), host=host, port=port, print=None, shutdown_timeout=10)
