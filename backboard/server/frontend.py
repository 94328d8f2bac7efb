"""The page at `/`: chat playground, live dashboard and scorecard viewer (static files in
server/static/, packaged with the wheel; no build step, nothing loaded from elsewhere), and the
small JSON API it reads. `backboard serve --disable-frontend` leaves all of it out.

    GET /, /dashboard, /scorecards      the page (one document; the path picks the tab)
    GET /static/...                     its scripts and style
    GET /api/auth                       whether the page must ask for an API key (no key needed)
    GET /api/info                       served models, chat template features, engine config
    GET /api/dashboard?since=T          DashboardStats.snapshot (server/dashboard.py)
    GET /api/scorecards                 results folders under the scorecard directory
    GET /api/scorecards/{name}          one folder's self-contained HTML report

The page itself loads without the API key (it has to ask for it); every /api/ route wants it
when the server has one, like the OpenAI routes."""

from __future__ import annotations

import asyncio
import glob
import os
from pathlib import Path
from typing import Any, Callable

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from backboard.server.dashboard import DashboardStats
from backboard.server.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATHS = ("/", "/dashboard", "/scorecards")
# the page runs its own scripts only and talks to this server only
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
       "script-src 'self'; connect-src 'self'; frame-src 'self'; object-src 'none'; base-uri 'none'")


def default_scorecard_dir() -> str | None:
    """benchmarks/results of a source checkout (the committed scorecards), if this is one."""
    d = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return str(d) if d.is_dir() else None


def install_frontend(app: FastAPI, state, authorized: Callable) -> None:
    """Routes and static files of the page; the dashboard starts listening to the engine."""
    dash = DashboardStats()
    dash.attach(state.engine)
    library = ScorecardLibrary(state.scorecard_dir or default_scorecard_dir())
    auth = [Depends(authorized)]

    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"content-security-policy": CSP,
                                                                 "cache-control": "no-cache"})

    for path in PAGE_PATHS:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/api/auth", include_in_schema=False)
    async def auth_needed() -> dict:
        return {"api_key_required": state.api_key is not None}

    @app.get("/api/info", dependencies=auth, include_in_schema=False)
    async def info() -> dict:
        return page_info(state, dash)

    @app.get("/api/dashboard", dependencies=auth, include_in_schema=False)
    async def dashboard(since: float | None = None) -> dict:
        return dash.snapshot(since)

    @app.get("/api/scorecards", dependencies=auth, include_in_schema=False)
    async def scorecards() -> dict:
        return {"root": library.root, "scorecards": library.listing()}

    @app.get("/api/scorecards/{name:path}", dependencies=auth, include_in_schema=False)
    async def scorecard(name: str) -> HTMLResponse:
        return HTMLResponse(await library.report(name))


def page_info(state, dash: DashboardStats) -> dict[str, Any]:
    from backboard import __version__

    template = str(getattr(state.tokenizer.hf, "chat_template", None) or "")
    return {"version": __version__, "models": list(state.served_names), "model_path": state.model_path,
            "max_model_len": state.max_model_len, "chat_template": bool(template),
            "thinking": "enable_thinking" in template,
            "engine": dash.engine_state()}


class ScorecardLibrary:
    """The results folders under one directory (itself included) that hold a sweep's results or
    a written scorecard.json; reports rendered off the event loop and cached until a file changes."""

    def __init__(self, root: str | None) -> None:
        self.root = os.path.abspath(root) if root else None
        self._cache: dict[str, tuple[float, str]] = {}

    def folders(self) -> dict[str, str]:
        """name (path relative to the root) -> folder."""
        if self.root is None or not os.path.isdir(self.root):
            return {}
        out = {}
        for d in [self.root] + sorted(glob.glob(os.path.join(self.root, "**", ""), recursive=True)):
            d = d.rstrip(os.sep)
            if _has_scorecard(d):
                out[os.path.relpath(d, self.root)] = d
        return out

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": name, "title": _title(d), "totals": _written_totals(d)}
                for name, d in self.folders().items()]

    async def report(self, name: str) -> str:
        d = self.folders().get(name)
        if d is None:
            raise APIError(404, f"no scorecard named {name!r} under {self.root}", "name", "not_found")
        written = _written_report(d)
        if written is not None:
            return written
        stamp = max(os.path.getmtime(p) for p in glob.glob(os.path.join(d, "**", "*"), recursive=True))
        hit = self._cache.get(name)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        from backboard.bench.scorecard_html import html_report

        try:
            text = await asyncio.get_running_loop().run_in_executor(None, html_report, d)
        except (ValueError, KeyError, OSError) as e:
            raise APIError(500, f"cannot build the scorecard of {name!r}: {e}") from e
        self._cache[name] = (stamp, text)
        return text


def _has_scorecard(d: str) -> bool:
    """A sweep's results folder (`backboard bench sweep` writes sweep.json at its top) or a
    written scorecard."""
    return any(os.path.isfile(os.path.join(d, f)) for f in ("scorecard.json", "sweep.json"))


def _written_report(d: str) -> str | None:
    """The folder's scorecard.html (`bench scorecard --html`), unless its scorecard.json is newer."""
    html, sc = os.path.join(d, "scorecard.html"), os.path.join(d, "scorecard.json")
    if not os.path.isfile(html) or (os.path.isfile(sc) and os.path.getmtime(sc) > os.path.getmtime(html) + 1):
        return None
    with open(html, encoding="utf-8") as f:
        return f.read()


def _title(d: str) -> str:
    readme = os.path.join(d, "README.md")
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8", errors="replace") as f:
            first = f.readline().strip()
        if first.startswith("#"):
            return first.lstrip("#").strip()
    return os.path.basename(d)


def _written_totals(d: str) -> dict | None:
    import json

    path = os.path.join(d, "scorecard.json")
    try:
        with open(path) as f:
            sc = json.load(f)
        return {"ours": sc["ours"], "totals": sc["totals"]}
    except (OSError, ValueError, KeyError):
        return None
