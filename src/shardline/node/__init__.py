"""Everything per machine: the daemon (`shardline node`), its node agent and runner processes, their logs."""
