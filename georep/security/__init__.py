"""The shells of security: the one factory for gRPC channels and ports with mutual TLS and the principal of a
call (``tls``), the development CA (``dev_ca``), the per-site Raft secret (``raft_secret``), the RPC table of
authorization (``acl_rpc``) and a puller's ACL sync (``acl_pull``). The decisions are pure, in ``georep/auth``."""
