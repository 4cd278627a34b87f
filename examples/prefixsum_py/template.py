#!POPCORN leaderboard prefixsum_py

def custom_kernel(data: list[int]) -> list[int]:
    """Inclusive prefix sum of `data`: out[i] = data[0] + ... + data[i]."""
    raise NotImplementedError
