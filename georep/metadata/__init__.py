"""A site's metadata, as every layer names it: topics and their configs (``topics``), and the ``MetadataStore``
port with the site's identity and its ACL records (``store``). Pure. The stores behind the port are shells:
``georep/storage/metadata_file.py`` (a one-node site) and ``georep/raft/store.py`` (a multi-node site)."""
