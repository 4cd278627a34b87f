#!POPCORN leaderboard prefixsum_py
"""A wrong submission: an exclusive scan (out[i] leaves data[i] out), a classic slip."""


def custom_kernel(data: list[int]) -> list[int]:
    total = 0
    out = []
    for x in data:
        out.append(total)
        total += x
    return out
