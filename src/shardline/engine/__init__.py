"""One instance on this machine: a node agent, an instance controller and a front in one process."""
