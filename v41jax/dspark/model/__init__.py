"""The DSpark drafter network: the parallel drafter over the frozen target's features
(`drafter`), its Markov head linking consecutive drafts (`markov`) and its confidence head
(`confidence`)."""
