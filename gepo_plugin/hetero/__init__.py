"""HeteroRL building blocks, framework-free: weight-delay models (and, with the HeteroRL work,
the staleness policy and rollout accounting) shared by the verl integration and the CPU lab."""
