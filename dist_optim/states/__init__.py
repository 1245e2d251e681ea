"""State formats: bitsandbytes' 8-bit blockwise moments (:mod:`.bnb`), 4/8-bit blockwise matrices
(:mod:`.lowbit`), the codecs through which every optimizer declares, decodes and encodes its state
entries and the one check of ``optim_bits`` (:mod:`.codecs`), and what a saved optimizer state is
and how it is checked (:mod:`.saved`)."""
