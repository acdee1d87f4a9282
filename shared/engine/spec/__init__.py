"""Speculative decoding's parts that need no model step (issue 13):

- `drafter.py`: what a drafter proposes (tokens, with a confidence per position)
  and the prompt-lookup (n-gram) drafter, which needs no weights;
- `calibration.py`: confidences calibrated per position from observed acceptance
  (DSpark's sequential temperature scaling);
- `schedule.py`: how many drafted tokens of each request to verify this step
  (DSpark's Algorithm 1, maximising Θ = τ · SPS(B), and its production variant);
- `rejection.py`: lossless verification, greedy and by rejection sampling.

The engine's verify step (several tokens per request, rollback of rejected slots
in every KV group) builds on these.
"""
