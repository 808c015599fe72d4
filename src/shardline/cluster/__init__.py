"""Many nodes as one: membership, election, the master (a pure fold and its shell), placement, weights."""
