"""flasharray: FlashAttention for NumPy and CuPy arrays (API filled in by the foundation work)."""
__version__ = "0.1.0"
