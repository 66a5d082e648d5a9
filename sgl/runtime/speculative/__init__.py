"""Speculative decoding: several tokens per forward pass.

A decode step of a small model on the CPU (or any model on a GPU) is bound by reading the
weights, so scoring k+1 tokens of one request costs about what scoring one does. Each
decode step of a speculating request therefore runs as a short extend:

    fill_ids:  ... | pending (1, or a jump-forward run) | d_0 d_1 .. d_{k-1}   <- drafts
    logits:                         row 0 ............ row k
    accepted:  d_j while the target picks d_j at row j; then one token of the target's own
               (the correction at the first mismatch, or a bonus after all k)

so a step yields 1..k+1 tokens, each exactly what plain decoding would have produced
(greedy), or distributed as the target would sample it (the rejection rule in verify.py).

Who does what:
  - a `Proposer` (proposer.py; ngram.py, draft_model.py) guesses drafts from the
    scheduler's side, where the token history lives; drafts the request's grammar forbids
    are cut there (`clip_to_grammar`), so verification never meets an illegal draft;
  - the scheduler (scheduler/speculate.py) gives the drafts KV slots for this step only,
    and after the step keeps the slots of the accepted ones and frees the rest;
  - the executor (verify.py) masks, samples and accepts position by position, and answers
    with the accepted tokens: the scheduler never sees logits.
"""
