#!/usr/bin/python3
"""A two-phase prefill/decode proxy in Python (aiohttp): the benchmark baseline for eldr-proxy.

Benchmark-only. It does what vLLM's example disaggregation proxies do, and nothing more: send the
client's request to a prefill instance with max_tokens=1 and kv_transfer_params.do_remote_decode,
take the kv_transfer_params of its answer, send the client's request with them to a decode
instance, and stream that answer back chunk by chunk. Prefill and decode instances are picked
round robin; there is no router call, no retry, no metrics. docs/benchmarks.md ("eldr-proxy")
compares eldr-proxy's CPU time and added latency against this.

    /usr/bin/python3 bench/pd_proxy_baseline.py --port 8000 \
        --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200,127.0.0.1:8201
"""

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import uuid

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (see --port_file)")
    parser.add_argument("--prefill", required=True, help="host:port,... of prefill instances")
    parser.add_argument("--decode", required=True, help="host:port,... of decode instances")
    parser.add_argument("--port_file", default="", help="write {\"port\": N, \"pid\": P} here once listening")
    return parser.parse_args()


def prefill_body(body):
    """The client's body as a prefill request: one token, not streamed, KV kept for a remote decode."""
    request = dict(body)
    request["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        request.pop(key, None)
    return request


def make_app(args):
    prefill = itertools.cycle([f"http://{hp}" for hp in args.prefill.split(",") if hp])
    decode = itertools.cycle([f"http://{hp}" for hp in args.decode.split(",") if hp])

    async def on_startup(app):
        app["session"] = ClientSession(
            connector=TCPConnector(limit=0, limit_per_host=0), timeout=ClientTimeout(total=None)
        )

    async def on_cleanup(app):
        await app["session"].close()

    async def proxy(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body is not a JSON object"}}, status=400)
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        session = request.app["session"]
        async with session.post(next(prefill) + request.path, json=prefill_body(body), headers=headers) as answer:
            if answer.status != 200:
                return web.Response(status=answer.status, body=await answer.read(),
                                    content_type="application/json")
            prefilled = await answer.json()
        decode_request = dict(body)
        decode_request["kv_transfer_params"] = prefilled.get("kv_transfer_params") or {}
        async with session.post(next(decode) + request.path, json=decode_request, headers=headers) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=8 << 20)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", proxy)
    app.router.add_post("/v1/chat/completions", proxy)
    return app


async def serve(args):
    runner = web.AppRunner(make_app(args), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the bound port (args.port may be 0)
    if args.port_file:
        temporary = args.port_file + ".tmp"
        with open(temporary, "w") as out:
            json.dump({"port": port, "pid": os.getpid()}, out)
        os.replace(temporary, args.port_file)
    print(f"pd_proxy_baseline: listening on {args.host}:{port}", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(serve(parse_args()))
