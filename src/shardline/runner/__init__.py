"""One runner process, one stage of an instance generation: stage 0 leads the ring, the others follow."""
