"""Local numerics on whole tensors, no collective: matrix roots and eigenbases
(:mod:`.matrix_functions`), Newton-Schulz (:mod:`.newton_schulz`), triangular and Gram products
(:mod:`.structured`), multi-tensor scaling (:mod:`.multi_tensor`), the fused AdamW (:mod:`.fused_adam`)
and the planner's replay hook for pure functions (:mod:`.replay`)."""
