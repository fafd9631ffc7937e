"""Who is calling, and over what: principals from peer certificates (``principal``), the one factory for gRPC
channels and ports with mutual TLS (``tls``), and the authorization of calls (``acl``)."""
