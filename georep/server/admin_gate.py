"""Who may make an admin call of a plaintext node (``--insecure``): with an admin token, whoever presents it;
without one, a caller on this host. A TLS node authorizes every call, admin ones included, by its principal
(``georep/server/rpc.py``), and asks for no token."""

from __future__ import annotations

import hmac

from georep.broker.errors import NotAuthorized
from georep.server.rpc import Context


class AdminGate:
    """The check of a plaintext node's admin calls (``SetLink``, ``DecommissionNode``, ``PutAcl``...)."""

    def __init__(self, admin_token: str | None, authorizes: bool) -> None:
        self.admin_token = admin_token
        # Calls are authorized by principals (georep/server/rpc.py's Authorization, on a TLS node): the admin
        # token, the plaintext node's only check of admin calls, is not asked for then.
        self.authorizes = authorizes

    def check(self, context: Context, what: str) -> None:
        """Raise ``NotAuthorized`` unless the caller may make the admin call ``what`` (a TLS node checked its
        principal for the admin operation before the handler ran)."""
        if self.authorizes:
            return
        if self.admin_token is None:
            if not _is_loopback(context.peer()):
                raise NotAuthorized(
                    f"{what} from {context.peer()} refused: this node has no admin token, so only local callers "
                    "may; start it with --admin-token-file"
                )
            return
        presented = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(presented), f"Bearer {self.admin_token}"):
            raise NotAuthorized(
                f"{what} refused: missing or wrong admin token; pass the token the node was started with "
                "(--admin-token-file, or GEOREP_ADMIN_TOKEN / the data dir's admin.token for georep commands)"
            )


def _is_loopback(peer: str) -> bool:
    """grpc peer strings: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``."""
    return peer.startswith(("ipv4:127.", "ipv6:[::1]", "unix:"))
