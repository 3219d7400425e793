"""The chart's Argo CD health check (``charts/daedalus/files/argocd-health.lua``) run as Argo CD runs it: a Lua
runtime (lupa) with the resource as the global ``obj``; the script returns ``{status, message}``."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

SCRIPT = (Path(__file__).resolve().parents[2] / "charts" / "daedalus" / "files" / "argocd-health.lua").read_text()


def health(obj: dict[str, Any], runtime_name: str = "default") -> tuple[str, str]:
    """``(status, message)`` of ``obj`` (a JSON-like dict) under lupa's ``runtime_name`` (``default``, ``lua51``,
    ``lua54``)."""
    import lupa

    module = lupa if runtime_name == "default" else importlib.import_module(f"lupa.{runtime_name}")
    lua = module.LuaRuntime()
    lua.globals().obj = lua.table_from(json.loads(json.dumps(obj)), recursive=True)
    result = lua.execute(SCRIPT)
    assert set(dict(result.items())) == {"status", "message"}
    return result["status"], result["message"]
