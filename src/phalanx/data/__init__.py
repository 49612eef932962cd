"""Data: token sources read in a deterministic global order (the batch of step s is a function of seed and s)."""
