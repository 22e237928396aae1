"""Dynamic Token Normalization (Shao et al., ICLR 2022), one concept per module."""
