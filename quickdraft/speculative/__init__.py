"""Speculative decoding: drafting and exact verification."""
