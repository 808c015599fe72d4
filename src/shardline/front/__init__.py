"""Request state outside any runner: a front per instance on each node; it resubmits on a new generation."""
