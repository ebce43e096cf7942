"""Event loops for orbax calls that tear down properly when a read fails.

orbax runs each restore in a fresh asyncio loop (``asyncio_utils._run_sync_via_new_loop``)
and closes it without asyncio.run's teardown. When one tensor's read fails (a damaged
converted copy), the reads still in flight in tensorstore's threads later call
``loop.call_soon_threadsafe`` on the closed loop, and each prints a "RuntimeError: Event
loop is closed" traceback on stderr (20 or more for SmolLM2) around the one real error.

:func:`orbax_loops` makes the loops created meanwhile cancel their pending tasks and wait
for them before closing, as asyncio.run does, so those reads are cancelled and nothing is
printed. Nothing is silenced: only the loop's teardown changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Iterator


class _TidyLoop(asyncio.SelectorEventLoop):
    """A selector loop whose close() first cancels and awaits its pending tasks."""

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                self.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.run_until_complete(self.shutdown_asyncgens())
        super().close()


class _TidyPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _TidyLoop()


@contextlib.contextmanager
def orbax_loops() -> Iterator[None]:
    """While active, new event loops (orbax's) tear down as asyncio.run does."""
    with warnings.catch_warnings():  # the policy API is deprecated from Python 3.14
        warnings.simplefilter("ignore", DeprecationWarning)
        old = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(_TidyPolicy())
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_event_loop_policy(old)
