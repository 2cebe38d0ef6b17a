"""Several engine ranks, one per device (`scaleout.md` §2): process groups, the per-step lockstep
coordinator, MoE token dispatchers (`dispatch/`), expert placement and DP request placement."""
