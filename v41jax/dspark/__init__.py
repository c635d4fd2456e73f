"""DSpark (REFERENCE.md §4): a parallel drafter with Markov and confidence heads, trained on a
frozen target, and confidence-scheduled exact speculative decoding."""
