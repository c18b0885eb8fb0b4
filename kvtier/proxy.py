"""A small OpenAI-compatible proxy for prefill/decode disaggregation through the pool.

Each completion or chat request goes first to a prefill instance (kvtier
``kv_producer``) with ``max_tokens=1``, which returns once the prompt's blocks are
durable in the pool, then, unchanged, to a decode instance (``kv_consumer``),
which loads them; the decode instance's answer (streamed or not) is returned.
Instances are used round-robin. ``kvtier proxy --prefill URL --decode URL``.
"""

from __future__ import annotations

import itertools
import logging

from aiohttp import ClientSession, ClientTimeout, web

logger = logging.getLogger("kvtier.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def make_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600) -> web.Application:
    prefill_cycle, decode_cycle = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    app = web.Application()

    async def session(app_: web.Application):
        app_["session"] = ClientSession(timeout=ClientTimeout(total=timeout_s))
        yield
        await app_["session"].close()

    app.cleanup_ctx.append(session)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        http = request.app["session"]
        prefill_body = {**body, "max_tokens": 1, "stream": False}
        prefill_body.pop("max_completion_tokens", None)
        prefill_body.pop("stream_options", None)
        async with http.post(next(prefill_cycle) + request.path, json=prefill_body) as prefill:
            if prefill.status != 200:  # the prefill instance refused: say so, do not decode
                return web.Response(status=prefill.status, body=await prefill.read(),
                                    content_type=prefill.content_type)
            await prefill.read()
        async with http.post(next(decode_cycle) + request.path, json=body) as decode:
            if not body.get("stream"):
                return web.Response(status=decode.status, body=await decode.read(),
                                    content_type=decode.content_type)
            response = web.StreamResponse(status=decode.status, headers={"Content-Type": decode.content_type})
            await response.prepare(request)
            async for chunk in decode.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def models(request: web.Request) -> web.Response:
        async with request.app["session"].get(decode_urls[0] + "/v1/models") as reply:
            return web.Response(status=reply.status, body=await reply.read(), content_type=reply.content_type)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    for route in ROUTES:
        app.router.add_post(route, forward)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def serve(prefill_urls: list[str], decode_urls: list[str], host: str, port: int) -> None:
    print(f"kvtier proxy on http://{host}:{port}: prefill {prefill_urls}, decode {decode_urls}", flush=True)
    web.run_app(make_app(prefill_urls, decode_urls), host=host, port=port, print=None)
