"""Who may be part of a cluster: the shared key, TLS certificates, and the checks on what peers send."""
