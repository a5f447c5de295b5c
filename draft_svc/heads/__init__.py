"""Learned draft heads over the primary's features: the feature drafter's model, file and training."""
