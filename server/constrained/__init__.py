"""Constrained decoding: regex / JSON schema / choices compiled to token-level automata
(``grammar``). Jump-forward over the compressed FSM arrives in ``jump_forward`` ([4/9])."""
