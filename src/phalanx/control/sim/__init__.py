"""The scheduler's test bench: public cluster traces replayed through the same scheduling core that the
control plane runs, against baseline policies on the same cluster, placement and cost model."""
