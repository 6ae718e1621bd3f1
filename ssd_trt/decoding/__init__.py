"""Decoding strategies over engines: autoregressive, speculative (chain/tree), saguaro (SSD)."""
