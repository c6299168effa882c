"""vLLM's OpenAI-compatible HTTP API served from a replica's own engine, on loopback.

The app is vLLM's (``build_app`` + ``init_app_state``) bound to the replica's ``AsyncLLM``, so
requests over HTTP share the engine, its batching and its current weights with the replica's
token-in/token-out calls. It runs on the replica's engine loop under uvicorn, without signal
handlers (that loop is not in the main thread).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

HOST = "127.0.0.1"


async def start_openai_server(
    engine: Any, engine_args: dict[str, Any], port: int = 0
) -> tuple[Any, Any, int]:
    """Serve the OpenAI API of ``engine`` on ``127.0.0.1:port`` (0 = a free port).

    Returns ``(uvicorn_server, serve_task, port)``; stop it with ``server.should_exit = True`` and
    await the task. Raises RuntimeError when it has not started within 60 s.
    """
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))
    port = sock.getsockname()[1]
    argv = ["--model", str(engine_args["model"]), "--host", HOST, "--port", str(port)]
    argv += ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    supported = await engine.get_supported_tasks()
    app = build_app(args, supported, engine.model_config)
    await init_app_state(engine, app.state, args, supported)
    config = uvicorn.Config(app, host=HOST, port=port, log_level="warning", access_log=False)
    server = _quiet_server_class()(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    for _ in range(600):
        if server.started:
            return server, task, port
        if task.done():
            task.result()  # raises what stopped it
            break
        await asyncio.sleep(0.1)
    server.should_exit = True
    raise RuntimeError(f"vLLM's OpenAI server did not start on {HOST}:{port} within 60 s.")


def _quiet_server_class() -> type:
    import uvicorn

    class QuietServer(uvicorn.Server):
        def install_signal_handlers(self) -> None:  # not the main thread: leave signals alone
            pass

    return QuietServer
