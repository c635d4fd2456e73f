"""DSpark (DeepSeek-V4.1 report): a parallel drafter with Markov and confidence heads, trained on a
frozen target, and confidence-scheduled exact speculative decoding."""
