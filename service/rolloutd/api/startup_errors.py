"""Start-up failures of the API's servers, each told in one line a user can act on.

They are raised here, at the edge that binds the ports, and listed in
``rolloutd.startup.START_FAILURES`` by the composition root; the API imports nothing from it.
"""

from __future__ import annotations


class PortUnavailable(OSError):
    """A server could not bind its port; names the server, the address and the flag to change."""

    def __init__(self, server: str, address: str, flag: str, key: str, cause: str) -> None:
        super().__init__(
            f"{server} cannot listen on {address}: {cause}; pass {flag} another port "
            f"(or set {key}; 0 picks a free one), or stop whatever holds it"
        )
