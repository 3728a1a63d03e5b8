"""Online updates: the update-record format, the append-only log, publishers and the applier."""
