"""The server's own command-line options of ``python -m minivllm serve``, with vLLM's names and defaults (vLLM 0.32:
``FrontendArgs`` in ``vllm/entrypoints/launchers/cli_args.py``).

``--api-key`` falls back to the ``VLLM_API_KEY`` environment variable (``api_key(args)``, as vLLM's
``vllm/entrypoints/serve/middleware/register.py`` does), so that the key need not appear in ``ps``.
``--allowed-origins`` (default none: no cross-origin browser access), ``--allowed-methods``, ``--allowed-headers``
and ``--allow-credentials`` are vLLM's CORS options. ``--disable-fastapi-docs`` removes ``/docs``, ``/redoc`` and
``/openapi.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional


def _list(value: str) -> List[str]:
    """vLLM takes these lists as JSON (``'["http://a.example"]'``); a comma-separated list is accepted too."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the HTTP server's options to ``parser`` (the engine's are added by the caller)."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1 routes (default: $VLLM_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model)")
    parser.add_argument("--allowed-origins", type=_list, default=[],
                        help='origins allowed cross-origin requests, as JSON (\'["http://a.example"]\'); default none')
    parser.add_argument("--allowed-methods", type=_list, default=["*"], help="CORS methods (default all)")
    parser.add_argument("--allowed-headers", type=_list, default=["*"], help="CORS headers (default all)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /docs, /redoc or /openapi.json")
    return parser


def app_options(args: argparse.Namespace) -> Dict[str, Any]:
    """``build_app``'s (and ``run_server``'s) keyword options from parsed arguments."""
    return dict(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                disable_fastapi_docs=args.disable_fastapi_docs)


def api_key(args: argparse.Namespace) -> Optional[str]:
    """The key ``/v1`` routes require: ``--api-key``, else ``$VLLM_API_KEY``, else none."""
    return args.api_key or os.environ.get("VLLM_API_KEY") or None
