"""The one error type of `tailserve plan` / `doctor`: bad user input (unknown GPU, malformed config).

The CLI turns it into a one-line message and exit status 2; it never carries a traceback to the user.
"""

from __future__ import annotations

from tailserve.errors import TailserveError


class PlanError(TailserveError):
    """An input to the planner is unknown or malformed; the message says which and what to do."""
