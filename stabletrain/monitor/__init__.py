"""Training-dynamics monitors (docs/methods.md §7).

- :mod:`names`: metric names shared by the loop, metrics.jsonl and the plots; the 15
  quantities of AdamW² Eq. 1;
- :mod:`quantities`: the maths, tensors in and ``{name: float}`` out;
- :mod:`alerts`: malignant entropy-collapse alerts and crash forensics.

The figures drawn from a finished run directory are offline analysis: :mod:`stabletrain.analysis`.
"""
