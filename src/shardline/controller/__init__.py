"""The instance controller: one instance's generations, their bring-up, health judgement and restarts."""
