"""State formats: bitsandbytes' 8-bit blockwise moments (:mod:`.bnb`), 4/8-bit blockwise matrices
(:mod:`.lowbit`), and what a saved optimizer state is and how it is checked (:mod:`.saved`)."""
