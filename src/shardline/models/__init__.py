"""Model files: names and the cache, GGUF import, checks, footprints, synthetic models; store/: the files."""
