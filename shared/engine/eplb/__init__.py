"""Expert-parallel load balancing (EPLB, issue 28): where each MoE layer's experts
live across the ranks of an expert-parallel instance, with redundant replicas of the
hot ones. Torch-free (numpy): the placement is computed off the step loop from host
copies of the per-step expert counts.

- `placement.py`: a load matrix [layers, experts] to a typed placement (physical slot
  -> logical expert, logical expert -> its replicas): DeepSeek's hierarchical policy
  (groups to nodes, replicas within a node) where the group count allows, global
  otherwise; and the static placement it is measured against;
- `load_window.py`: a sliding window of per-step counts, and per-layer balancedness
  (mean/max tokens per rank) of a placement;
- `traces.py`: seeded synthetic routing traces, log-normal per-expert loads whose hot
  experts drift, for the simulation (`tools/bench/eplb_sim.py`) and the tests.
"""
