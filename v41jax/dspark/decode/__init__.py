"""DSpark decoding: the drafter as a plug-in of the speculative engine (`rounds`),
`dspark_generate` and the round-cost tables it is scheduled with (`engine`), the
confidence-scheduled verify widths (`scheduler`) and their admission rules (`admission`)."""
