"""Who a caller is and what it may do, as pure decisions: principals (``principal``), ACL entries and
``authorize`` (``acl``), ACL records as last-writer-wins registers (``acl_sync``), who may pull what and which
claims count (``acl_replication``), the decisions every front end asks (``policy``), SASL users' credentials
(``credentials``) and the SCRAM exchange (``sasl``). The shells that read certificates, keys and secrets are in
``georep/security``."""
