"""Tools: in the prompt and as a grammar (prompt.py), and calls read out of an answer (calls.py)."""
