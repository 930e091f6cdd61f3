"""Expert parallel: the experts of every MoE layer split over the ep ranks, tokens sent to them and back."""
