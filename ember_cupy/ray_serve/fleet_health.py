"""The application's /health: one answer from every live engine replica's own state.

- 200 {"status": "ready", "replicas": [...]}: every replica's engine is ready;
- 200 {"status": "degraded", ...}: some are not (loading, dead, unreachable) but at least one
  serves: the endpoint still answers requests (Serve replaces the failed ones);
- 503, the server's error body plus "status" and "replicas": no replica is ready (or none is live).
Each entry of "replicas" is a replica's health_report (replica.py): replica_id, state, error.
"""
from __future__ import annotations

from ember_cupy.server.errors import APIError

UNREACHABLE = "unreachable"


def summarize_health(reports: list) -> tuple[int, dict]:
    """(HTTP status, JSON body) from the replicas' health reports (an exception: a replica that
    did not answer)."""
    replicas = sorted((_entry(r) for r in reports), key=lambda e: (e["replica_id"] or "", e["state"]))
    ready = [e for e in replicas if e["state"] == "ready"]
    if ready:
        return 200, {"status": "ready" if len(ready) == len(replicas) else "degraded", "replicas": replicas}
    message = ("no engine replica is live" if not replicas else
               f"no engine replica is ready ({', '.join(sorted({e['state'] for e in replicas}))})")
    body = APIError(503, message, code="no_ready_replica").body()
    return 503, {**body, "status": UNREACHABLE if not replicas else "not_ready", "replicas": replicas}


def _entry(report) -> dict:
    if isinstance(report, BaseException):
        first_line = (str(report).strip().splitlines() or [""])[0]
        return {"replica_id": None, "state": UNREACHABLE, "error": f"{type(report).__name__}: {first_line}"}
    return report
