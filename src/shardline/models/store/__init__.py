"""A model directory on disk: its files, its manifest of hashes, and the checks against them."""
