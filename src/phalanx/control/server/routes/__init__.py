"""The API's routes, a router per resource (the FastAPI template's layout). Each route validates, calls the
tenant-scoped access layer (store/access.py) or the lifecycle, and shapes the answer.

Routes that only read the database are ``async def`` and open their transaction inside (``server.scope``),
with no ``await`` while it is open: a thread hop costs more than the queries of a request (a route with a
sync dependency runs about 1,000 requests/s here, an async one 5,000), and reads never wait for a writer
(SQLite in WAL mode, PostgreSQL's MVCC). Routes that write run in the thread pool: they may wait for the
store's write lock, and a submission parses its spec and checks its files (launch/preflight.py); neither may
hold up the event loop, which answers everyone. So do routes that read run directories (a job's progress,
logs, metrics): an async route touches nothing but the database."""

from fastapi import APIRouter

from phalanx.control.server.inputs import StrictJSONRoute


def router() -> APIRouter:
    """A router whose JSON bodies are parsed strictly (inputs.py): hostile input is a 422, never a 500."""
    return APIRouter(route_class=StrictJSONRoute)
